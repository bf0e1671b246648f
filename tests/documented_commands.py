"""The shell commands of README.md and docs/: read from their ```bash blocks, and the tiny stand-ins (models, data
files) that make the paths those commands name exist in a sandbox folder.

A block's commands are its lines with continuations joined and comment lines dropped; a here-document
(`python - <<'PY' ... PY`) stays part of its command."""

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    index: int  # 0-based among the page's ```bash blocks
    commands: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}#{self.index}"


def bash_commands(source: str) -> list[str]:
    """The commands of one ```bash block, in order: continuation lines joined, comment lines dropped, a
    here-document kept with the command that opens it."""
    commands: list[str] = []
    lines = source.replace("\\\n", " ").splitlines()
    while lines:
        line = lines.pop(0)
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            body = [line]
            while lines:
                body.append(lines.pop(0))
                if body[-1].strip() == heredoc.group(1):
                    break
            line = "\n".join(body)
        commands.append(line)
    return commands


def bash_blocks(page: Path) -> list[Block]:
    sources = re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    return [Block(page, index, tuple(bash_commands(source))) for index, source in enumerate(sources)]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in bash_blocks(page)]


# The data files the docs' commands name, small enough that every fine-tune runs in seconds.
def write_data_files(folder: Path, stories: list[str]) -> None:
    """train/valid as .txt (text), .jsonl (text, label, target) and .csv (text, target), and chats(-valid).jsonl in
    the messages format."""
    train, valid = stories[:48], stories[48:64]
    for name, texts in (("train", train), ("valid", valid)):
        (folder / f"{name}.txt").write_text("\n".join(texts) + "\n")
        rows = [
            {"text": text, "label": "long" if len(text) > 200 else "short", "target": " ".join(text.split()[::-1])}
            for text in texts
        ]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        with open(folder / f"{name}.csv", "w", newline="") as file:  # the csv module quotes what needs quoting
            writer = csv.writer(file)
            writer.writerow(["text", "target"])
            writer.writerows([row["text"].replace("\n", " "), row["target"].replace("\n", " ")] for row in rows)
    for name, texts in (("chats", train), ("chats-valid", valid)):
        conversations = [
            {"messages": [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": text}]}
            for text in texts
        ]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in conversations))
