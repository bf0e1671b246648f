"""Writing output folders safely: build beside the target, move into place only when complete.

Every command that writes a folder (`vaswani convert`, `vaswani export`, `vaswani finetune`) goes through here, so
a failure part-way never leaves a half-written folder and never deletes what the user had.

Example:
    >>> from pathlib import Path
    >>> from vaswani.folders import check_output_folder, staged_folder
    >>> check_output_folder(Path("out"), overwrite=False)  # FileExistsError if out/ holds files
    >>> with staged_folder(Path("out")) as staging:
    ...     (staging / "config.json").write_text("{}")  # out/ appears (or is replaced) only when the block succeeds
"""

import contextlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def check_output_folder(folder: Path, overwrite: bool) -> None:
    """Refuse a path that is a file, or a non-empty folder unless `overwrite`: checked before any work is done."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder; pass a folder path.")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{folder} exists and is not empty; pass overwrite=True (--overwrite) to replace it, or choose another "
            f"folder."
        )


def replace_folder(staging: Path, target: Path) -> None:
    """Move the complete `staging` folder to `target`. An older `target` is moved aside first and deleted only once
    the new one is in place (and restored if the move fails)."""
    previous = target.parent / f".{target.name}.previous-{uuid.uuid4().hex[:8]}"
    if target.exists():
        target.rename(previous)
    try:
        staging.rename(target)
    except BaseException:
        if previous.exists():
            previous.rename(target)
        raise
    shutil.rmtree(previous, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """A new folder beside `target` that replaces it when the block succeeds; on failure it is removed, together
    with any parent folder this created, and `target` is left as it was."""
    created = next((parent for parent in reversed(target.parents) if not parent.exists()), None)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
        replace_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise
