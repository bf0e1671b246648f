"""The commands and programs of README.md and docs/, the tiny stand-ins (models, data files) that make the paths they
name exist in a sandbox folder, and the runner that plays one page in that sandbox.

A ```bash block's commands are its lines with continuations joined and comment lines dropped; a here-document
(`python - <<'PY' ... PY`) stays part of its command. A ```python block is a program, or the next cell of the page's
session (the page's blocks share one namespace, as the page reads). An inline command is a code span outside the
fenced blocks that starts with a command word (`vaswani ...`, `python ...`, `make ...`).

    python tests/documented_commands.py PLAN.json            # in the sandbox: play a page's plan (`run_plan`)
    python tests/documented_commands.py --parse CHECKS.json  # in the repository: `parse_only` for each command
"""

import ast
import contextlib
import csv
import io
import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The words an inline code span starts with when it is a command to type, not a name in prose.
COMMAND_WORDS = ("vaswani", "python", "python3", ".venv/bin/python", "make", "curl", "pip", "bash", "torchrun",
                 "accelerate", "vllm", "pytest")


@dataclass(frozen=True)
class Block:
    page: Path
    index: int  # 0-based among the page's ```bash blocks
    commands: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}#{self.index}"


def quotes_closed(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:  # "No closing quotation"
        return False
    return True


def bash_commands(source: str) -> list[str]:
    """The commands of one ```bash block, in order: continuation lines joined, comment lines dropped, a
    here-document or a quoted argument over several lines kept with the command that opens it."""
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
        while lines and not quotes_closed(line):  # a quoted argument that goes on over lines (curl's -d '{...}')
            line += "\n" + lines.pop(0)
        commands.append(line)
    return commands


def fenced_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, source) of every ```bash and ```python block of the page, in the page's order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def bash_blocks(page: Path) -> list[Block]:
    sources = [source for language, source in fenced_blocks(page) if language == "bash"]
    return [Block(page, index, tuple(bash_commands(source))) for index, source in enumerate(sources)]


def python_blocks(page: Path) -> list[str]:
    return [source for language, source in fenced_blocks(page) if language == "python"]


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in bash_blocks(page)]


def inline_commands(page: Path) -> list[str]:
    """The page's inline code spans (outside fenced blocks) that are commands: they start with a command word."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose)
    # A command word alone (`make`, `python`) names a program, not a command.
    return [span for span in spans if span.split()[0] in COMMAND_WORDS and len(span.split()) > 1]


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


# -------------------------------------------------------------------------------- what the checks call on
def option(command: str, flag: str) -> str:
    """The value of `flag` in a shell command line."""
    words = shlex.split(command, comments=True)
    return words[words.index(flag) + 1]


def greedy_by_hand(model, input_ids, new_tokens: int, eos_token_id: int | None = None):
    """Greedy decoding without a cache: each next token is the argmax of a full forward over everything so far.
    The oracle for `generate(do_sample=False)`, which uses the cache."""
    import torch

    tokens = input_ids
    with torch.no_grad():
        for _ in range(new_tokens):
            next_token = model(tokens).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=-1)
            if eos_token_id is not None and next_token.item() == eos_token_id:
                break
    return tokens


def completion_answer(stdout: str) -> dict:
    """A non-streaming /v1/completions answer, checked: one choice with text, a finish reason, token counts."""
    answer = json.loads(stdout)
    assert answer["object"] == "text_completion", answer
    (choice,) = answer["choices"]
    assert choice["text"] and choice["finish_reason"] in ("stop", "length"), answer
    assert 0 < answer["usage"]["completion_tokens"], answer
    return answer


def request_body(command: str) -> dict:
    """The JSON body a curl command sends (its `-d` argument)."""
    arguments = shlex.split(command)
    return json.loads(arguments[arguments.index("-d") + 1])


def structured_answer(command: str, stdout: str) -> dict:
    """A /v1/completions answer held to the request's `response_format` json_schema: it ended with "stop" and its text
    validates against the schema the command sent (jsonschema, the independent oracle)."""
    import jsonschema

    answer = completion_answer(stdout)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "stop", answer
    schema = request_body(command)["response_format"]["json_schema"]["schema"]
    jsonschema.validate(json.loads(choice["text"]), schema)
    return answer


def tool_call_answer(command: str, stdout: str) -> dict:
    """A chat answer to a request with tools and tool_choice "required": tool calls to the request's tools, each one's
    arguments valid under its tool's parameters."""
    import jsonschema

    answer = json.loads(stdout)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"], answer
    tools = {tool["function"]["name"]: tool["function"]["parameters"] for tool in request_body(command)["tools"]}
    for call in choice["message"]["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_"), call
        jsonschema.validate(json.loads(call["function"]["arguments"]), tools[call["function"]["name"]])
    return answer


def streamed_chat(stdout: str) -> str:
    """A streamed /v1/chat/completions answer (server-sent events), checked: every event a chat.completion.chunk,
    the last `data: [DONE]`; returns the text."""
    events = [line.removeprefix("data: ") for line in stdout.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", stdout[-2000:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks), chunks
    text = "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])
    assert text, stdout[-2000:]
    return text


# ------------------------------------------------------------------------------- commands that are only parsed
class Parsed(BaseException):
    """Raised as soon as the program's command line has been parsed: what it would do next does not run."""


def parse_only(words: list[str], fragment: bool) -> str | None:
    """Whether the program `words` names (`vaswani ...`, `python SCRIPT ...`, `python -m MODULE ...`) accepts its
    arguments: it runs up to its argument parser (imports, parser set-up) and stops there. None if they parse, else
    the parser's complaint. A `fragment` is prose naming a command and some of its options: only a missing required
    argument (or the value of a last option) is allowed. Runs in this process, `argparse` patched for the call."""
    import argparse
    import runpy

    parse_known_args, error, depth = argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.error, [0]

    def parse_and_stop(self, args=None, namespace=None):
        depth[0] += 1
        try:
            namespace, extras = parse_known_args(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:  # the outermost parse (subcommands parse inside it)
            raise Parsed(" ".join(extras))
        return namespace, extras

    def complain(self, message):
        if fragment and message.startswith("the following arguments are required"):
            return
        if fragment and words[-1].startswith("-") and re.search(r"expected (at least )?one argument", message):
            raise Parsed("")  # prose naming an option (`vaswani export --model`): it exists, its value is the prose's
        raise Parsed(f"error: {message}")

    argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.error = parse_and_stop, complain
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        if words[0] == "vaswani":
            from vaswani.cli.main import main

            main(words[1:])
        elif words[1] == "-m":
            sys.argv = [words[2], *words[3:]]
            sys.path.insert(0, os.getcwd())  # as `python -m MODULE` does
            runpy.run_module(words[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = words[1:]
            sys.path.insert(0, str(Path(words[1]).resolve().parent))  # as `python SCRIPT` does
            runpy.run_path(words[1], run_name="__main__")
        return "the program ran past its argument parser without parsing"
    except Parsed as stopped:
        complaint = str(stopped)
        return None if not complaint else complaint if complaint.startswith("error:") else f"unrecognized: {complaint}"
    except SystemExit as exit:  # --help prints and exits 0
        return None if exit.code in (0, None) and "--help" in words else f"exit {exit.code}"
    finally:
        argparse.ArgumentParser.parse_known_args, argparse.ArgumentParser.error = parse_known_args, error
        sys.argv, sys.path[:] = saved_argv, saved_path


# ------------------------------------------------------------------------------------------- playing a page
# A plan is a list of steps, each a dict: {"kind": "bash", "command", "check"}, {"kind": "serve", "command", "url"}
# or {"kind": "python", "name", "given", "source", "check"}. `check` is Python run in the page's namespace after the
# step: a bash step's output is `stdout` there; a python step's top-level expression values are `outputs`, and what it
# printed `printed`.
ENVIRONMENT_FILE = ".documented-environment"  # what the page's commands `export`ed, for the commands after them


def recording_expressions(source: str, name: str):
    """`source` compiled so that each top-level expression statement's value is appended to `outputs` (a notebook
    shows them; the page's prose describes them), nothing else changed."""
    tree = ast.parse(source, filename=name)
    for index, statement in enumerate(tree.body):
        if isinstance(statement, ast.Expr):
            record = ast.parse("outputs.append(None)").body[0]
            record.value.args = [statement.value]
            tree.body[index] = ast.copy_location(record, statement)
    return compile(ast.fix_missing_locations(tree), name, "exec")


class Tee(io.StringIO):
    """Keeps what a Python block prints (for its check) and shows it too."""

    def __init__(self, shown):
        super().__init__()
        self.shown = shown

    def write(self, text: str) -> int:
        self.shown.write(text)
        return super().write(text)


def run_bash(command: str) -> str:
    """Run one command with `bash -e -o pipefail` after the page's earlier exports; echo and return its stdout."""
    script = f"[ -f {ENVIRONMENT_FILE} ] && . ./{ENVIRONMENT_FILE}\n{command}\nexport -p > {ENVIRONMENT_FILE}\n"
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], capture_output=True, text=True)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr[-4000:])
    if result.returncode:
        raise SystemExit(f"exit status {result.returncode}: {command}")
    return result.stdout


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    unverified = ssl._create_unverified_context()  # the docs' TLS command uses a self-signed certificate
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2, context=unverified) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"no answer from {url}/health in {timeout:.0f} s")


def stop(server: subprocess.Popen | None) -> None:
    if server is not None and server.poll() is None:
        server.terminate()
        server.wait(timeout=60)


def run_plan(steps: list[dict]) -> None:
    """Play a page's steps in order in the current folder: bash commands one by one (a page's `export`s carry over),
    `vaswani serve` in the background until the next one or the end, Python blocks in one shared namespace; after
    each step its check. Any failure ends the run with a message naming the step."""
    namespace: dict = {"__name__": "__main__"}
    server = None
    try:
        for step in steps:
            print(f"\n>>> {step.get('name') or step['command']}", flush=True)
            if step["kind"] == "serve":
                stop(server)
                prologue = f"[ -f {ENVIRONMENT_FILE} ] && . ./{ENVIRONMENT_FILE}; "
                server = subprocess.Popen(["bash", "-c", prologue + f"exec {step['command']}"])
                wait_ready(step["url"], server)
                continue
            if step["kind"] == "bash":
                namespace["command"], namespace["stdout"] = step["command"], run_bash(step["command"])
            else:
                exec(compile(step["given"], f"{step['name']} (given)", "exec"), namespace)
                namespace["outputs"], printed = [], Tee(sys.stdout)
                with contextlib.redirect_stdout(printed):
                    exec(recording_expressions(step["source"], step["name"]), namespace)
                namespace["printed"] = printed.getvalue()
            exec(compile(step["check"], f"check of {step.get('name') or step['command']}", "exec"), namespace)
    finally:
        stop(server)


if __name__ == "__main__":
    if sys.argv[1] == "--parse":  # a JSON list of [words, fragment]: print a JSON list of complaints (None: parses)
        checks = json.loads(Path(sys.argv[2]).read_text())
        complaints = [parse_only(words, fragment) for words, fragment in checks]
        print("PARSED " + json.dumps(complaints))
    else:
        run_plan(json.loads(Path(sys.argv[1]).read_text()))
