"""The `vaswani` command table (`vaswani.cli.main`): a subcommand is one module and one row of `COMMANDS`.

A toy subcommand, written by the test as a module of its own, is registered with one row and runs through `main()`:
its flags, its exit code, its `args.parser.error`, its line in `vaswani --help`, a command whose own parser reads
every word (as `finetune` hands its words to transformers' HfArgumentParser). A command whose module cannot even be
imported shows that only the command being run is imported; a fresh process shows what `vaswani --help` loads.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vaswani.cli.main as cli_main
from vaswani.cli.main import main

GREET = '''
    """`vaswani greet NAME`: greets NAME, a toy subcommand of tests/test_cli.py.

    This second paragraph is not the description.
    """

    import argparse
    import json

    from vaswani.cli.options import add_json_argument, at_least_one

    EPILOG = "exit status: 3, so that the test sees the command's own code come back."


    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--times", type=at_least_one, default=1, help="greetings (1)")
        parser.add_argument("--shout", action="store_true")
        add_json_argument(parser)


    def run(args: argparse.Namespace) -> int:
        if args.shout and args.name.islower():
            args.parser.error(f"--shout needs a capitalised name, not {args.name!r}")
        greeting = " ".join([f"hello {args.name}"] * args.times)
        print(greeting.upper() if args.shout else greeting)
        if args.json:
            args.json.write_text(json.dumps({"greeting": greeting}))
        return 3
'''

ECHO_WORDS = '''
    """`vaswani echo-words ...`: hands every word to its own parser, as `vaswani finetune` does."""

    import argparse

    OWN_FLAGS = True
    received = []


    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("words", nargs=argparse.REMAINDER)


    def run(args: argparse.Namespace) -> int:
        received.append(args.words)
        return 0
'''

BROKEN = '''
    raise ImportError("a command's module is imported only when that command runs")
'''


@pytest.fixture
def toy_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Three toy commands, each a module written to `tmp_path` and one row in `COMMANDS`."""
    modules = {"toy_greet": GREET, "toy_echo_words": ECHO_WORDS, "toy_broken": BROKEN}
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = {
        "greet": ("toy_greet", "greet someone by name"),
        "echo-words": ("toy_echo_words", "hand every word to the command"),
        "broken": ("toy_broken", "a command whose module fails to import"),
    }
    for command, row in rows.items():
        monkeypatch.setitem(cli_main.COMMANDS, command, row)
    return rows


def test_a_new_subcommand_is_one_module_and_one_row(toy_commands, tmp_path, capsys) -> None:
    written = tmp_path / "greeting.json"
    assert main(["greet", "Ada", "--times", "2", "--json", str(written)]) == 3
    assert capsys.readouterr().out == "hello Ada hello Ada\n"
    assert json.loads(written.read_text()) == {"greeting": "hello Ada hello Ada"}
    assert main(["greet", "Ada", "--shout"]) == 3
    assert capsys.readouterr().out == "HELLO ADA\n"


def test_a_new_subcommand_is_listed_and_has_its_own_help(toy_commands, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["--help"])
    assert raised.value.code == 0
    listing = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "greet greet someone by name" in listing and "echo-words hand every word" in listing
    assert "convert convert a transformers checkpoint folder" in listing  # the package's own rows stay

    with pytest.raises(SystemExit) as raised:
        main(["greet", "--help"])
    assert raised.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "usage: vaswani greet [-h] [--times TIMES] [--shout] [--json FILE] name" in help_text
    assert "`vaswani greet NAME`: greets NAME, a toy subcommand of tests/test_cli.py." in help_text
    assert "second paragraph" not in help_text
    assert "exit status: 3, so that" in help_text


@pytest.mark.parametrize(
    "words, message",
    [
        (["greet", "ada", "--shout"], "--shout needs a capitalised name, not 'ada'"),  # the command's own check
        (["greet", "Ada", "--times", "0"], "argument --times: must be at least 1, got 0"),  # a shared option type
        (["greet"], "the following arguments are required: name"),
        (["greet", "Ada", "--loud"], "unrecognized arguments: --loud"),
    ],
)
def test_a_new_subcommand_refuses_bad_input_with_status_2(toy_commands, capsys, words, message) -> None:
    with pytest.raises(SystemExit) as raised:
        main(words)
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: vaswani") and message in error


def test_a_command_with_its_own_parser_gets_every_word(toy_commands) -> None:
    words = ["--help", "-x", "--model", "m", "--learning_rate=1e-4", "plain"]
    assert main(["echo-words", *words]) == 0
    assert main(["echo-words"]) == 0
    assert sys.modules["toy_echo_words"].received == [words, []]


def test_only_the_command_being_run_is_imported(toy_commands, capsys) -> None:
    assert main(["greet", "Ada"]) == 3  # the toy_broken module would raise, were it imported
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "toy_broken" not in sys.modules
    with pytest.raises(ImportError, match="imported only when that command runs"):
        main(["broken"])


def test_every_command_module_keeps_the_contract() -> None:
    """Each row's module has `add_arguments` and `run`, and a description: its docstring or DESCRIPTION."""
    import importlib

    for command, (module_name, help_text) in cli_main.COMMANDS.items():
        module = importlib.import_module(module_name, "vaswani.cli")
        assert callable(module.add_arguments) and callable(module.run), command
        assert (module.__doc__ or "").startswith(f"`vaswani {command}"), command
        assert help_text and not help_text.endswith("."), command


def test_help_imports_no_command_module_and_no_runtime() -> None:
    """`vaswani --help` in a fresh process, as a user types it: no subcommand's module, nothing of ONNX, ONNX
    Runtime, OpenVINO or the server, none of the package's rooms but the command table. (torch itself loads with the
    `vaswani` package, whose import registers the model classes with transformers' Auto classes.)"""
    script = (
        "import sys\n"
        "from vaswani.cli.main import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0, done.code\n"
        "print('MODULES', ' '.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    modules = set(done.stdout.split("MODULES", 1)[1].split())
    assert "vaswani.cli.main" in modules
    commands = {f"vaswani.cli{name}" for name, _ in cli_main.COMMANDS.values()}
    rooms = {f"vaswani.{room}" for room in ("runtime", "export", "quantization", "serving", "evaluation", "training")}
    libraries = {"onnx", "onnxruntime", "onnxscript", "openvino", "fastapi", "uvicorn", "datasets", "peft", "ray"}
    assert not modules & (commands | rooms | libraries)
    assert not any(module.startswith(tuple(f"{room}." for room in rooms)) for module in modules)


@pytest.mark.parametrize("words", [["finetune", "--help"], ["finetune", "--model"]])
def test_finetune_hands_its_words_to_the_trainers_parser(words, capsys) -> None:
    """`vaswani finetune` goes through the table like any command, and HfArgumentParser reads its flags: its help
    lists the Trainer's flags, and a flag without its value is HfArgumentParser's error (status 2)."""
    pytest.importorskip("datasets")
    with pytest.raises(SystemExit) as raised:
        main(words)
    output = capsys.readouterr()
    if words[1] == "--help":
        assert raised.value.code == 0
        assert "usage: vaswani finetune" in output.out
        assert all(flag in output.out for flag in ("--train_file", "--output_dir", "--learning_rate", "--lora"))
    else:
        assert raised.value.code == 2
        assert "argument --model: expected one argument" in output.err


def test_engine_choices_are_the_runtimes_and_grow_with_a_registered_one(monkeypatch, capsys) -> None:
    """`--engine`'s choices are spelled out (so `vaswani --help` imports no runtime) and equal the runtime's own; a
    decoder runtime registered in this process before `main` reads the command line is a choice too."""
    from vaswani.cli import options
    from vaswani.runtime import decoders

    assert options.ENGINES == decoders.engines()
    words = ["bench", "some-folder", "--engine", "toy", "--help"]
    with pytest.raises(SystemExit) as raised:
        main(words)
    assert raised.value.code == 2 and "invalid choice: 'toy'" in capsys.readouterr().err

    toy = type("ToyRuntime", (), {"name": "toy-runtime", "engine": "toy"})
    monkeypatch.setitem(decoders.DECODER_RUNTIMES, toy.name, toy)
    with pytest.raises(SystemExit) as raised:
        main(words)
    assert raised.value.code == 0 and "{onnxruntime,openvino,auto,toy}" in capsys.readouterr().out
