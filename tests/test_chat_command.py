"""`vaswani chat`: its answers are offline `generate` on the chat-templated conversation, for a PyTorch folder and its
fp32 ONNX export; one-shot (--prompt), multi-turn (stdin), sampled (--temperature, --seed) and streamed."""

import io
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vaswani.cli.chat import ChatOptions, chat_reply, chat_session
from vaswani.cli.main import main as vaswani_cli
from vaswani.runtime.loading import load_folder

pytest.importorskip("onnxruntime")

NEW_TOKENS = 8
SYSTEM = "You tell short stories."


@pytest.fixture
def folders(tiny_chat_pair: dict[str, Path]) -> dict[str, Path]:
    return tiny_chat_pair


def offline_reply(folder: Path, messages: list[dict], **options) -> str:
    """The oracle: transformers' PyTorch model's `generate` on the template-rendered conversation, decoded."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    tokens = model.generate(**prompt, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_token_id, **options)
    return tokenizer.decode(tokens[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def chat_command(capsys: pytest.CaptureFixture, *flags: str) -> str:
    assert vaswani_cli(["chat", *flags, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("form", ["pytorch", "onnx"])
def test_prompt_prints_the_greedy_answer_alone(folders, form: str, capsys: pytest.CaptureFixture) -> None:
    output = chat_command(capsys, str(folders[form]), "--system", SYSTEM, "--prompt", "Tell me a story.")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a story."}]
    expected = offline_reply(folders["pytorch"], messages, do_sample=False)
    assert output == expected + "\n"


@pytest.mark.parametrize("form", ["pytorch", "onnx"])
def test_second_turn_answers_the_whole_conversation(folders, form: str) -> None:
    loaded = load_folder(folders[form], task="text-generation")
    lines, output = io.StringIO("Hi\n\nWhy is the sky blue?\n"), io.StringIO()
    chat_session(loaded, ChatOptions(max_new_tokens=NEW_TOKENS), SYSTEM, lines, output)
    first, second = output.getvalue().split("\n")[:2]
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    assert first == offline_reply(folders["pytorch"], conversation, do_sample=False)
    conversation += [{"role": "assistant", "content": first}, {"role": "user", "content": "Why is the sky blue?"}]
    assert second == offline_reply(folders["pytorch"], conversation, do_sample=False)
    assert output.getvalue() == f"{first}\n{second}\n"  # no "> " prompt: stdin is not a terminal


def test_reset_starts_a_new_conversation(folders) -> None:
    loaded = load_folder(folders["pytorch"], task="text-generation")
    lines, output = io.StringIO("Hi\n/reset\nWhy is the sky blue?\n/exit\nHi\n"), io.StringIO()
    chat_session(loaded, ChatOptions(max_new_tokens=NEW_TOKENS), None, lines, output)
    answers = output.getvalue().split("\n")[:-1]
    assert len(answers) == 2  # /exit ended the session before the last line
    fresh = [{"role": "user", "content": "Why is the sky blue?"}]
    assert answers[1] == offline_reply(folders["pytorch"], fresh, do_sample=False)


class Terminal(io.StringIO):
    """Lines typed at a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_prompt_before_each_line(folders) -> None:
    loaded = load_folder(folders["onnx"], task="text-generation")
    output = io.StringIO()
    chat_session(loaded, ChatOptions(max_new_tokens=NEW_TOKENS), None, Terminal("Hi\n"), output)
    answer = offline_reply(folders["pytorch"], [{"role": "user", "content": "Hi"}], do_sample=False)
    assert output.getvalue() == f"> {answer}\n> "


@pytest.mark.parametrize("form", ["pytorch", "onnx"])
def test_seeded_sampling_matches_generate(folders, form: str, capsys: pytest.CaptureFixture) -> None:
    state = torch.random.get_rng_state()
    output = chat_command(capsys, str(folders[form]), "--prompt", "Hi", "--temperature", "0.8", "--seed", "3")
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left as it was
    torch.manual_seed(3)
    expected = offline_reply(
        folders["pytorch"], [{"role": "user", "content": "Hi"}], do_sample=True, temperature=0.8, top_k=0, top_p=1.0
    )
    assert output == expected + "\n"
    greedy = offline_reply(folders["pytorch"], [{"role": "user", "content": "Hi"}], do_sample=False)
    torch.manual_seed(4)
    other_seed = offline_reply(
        folders["pytorch"], [{"role": "user", "content": "Hi"}], do_sample=True, temperature=0.8, top_k=0, top_p=1.0
    )
    assert expected != greedy or expected != other_seed  # the sampled path really samples


@pytest.mark.parametrize("form", ["pytorch", "onnx"])
def test_streamed_pieces_concatenate_to_the_answer(folders, form: str) -> None:
    loaded = load_folder(folders[form], task="text-generation")
    pieces: list[str] = []
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    answer = chat_reply(loaded, messages, ChatOptions(max_new_tokens=NEW_TOKENS), stream=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == answer
    assert answer == offline_reply(folders["pytorch"], messages, do_sample=False)


def test_folder_without_chat_template_is_refused(folders, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "no-template"
    model = AutoModelForCausalLM.from_pretrained(folders["pytorch"])
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folders["pytorch"])
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert vaswani_cli(["chat", str(folder), "--prompt", "Hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no chat template" in captured.err and "chat_template" in captured.err


def test_non_generation_folder_is_refused(folders, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from conftest import build_model, tiny_encoder_config

    from vaswani import VaswaniForMaskedLM

    folder = tmp_path / "masked"
    build_model(VaswaniForMaskedLM, tiny_encoder_config(), "sdpa").save_pretrained(folder)
    AutoTokenizer.from_pretrained(folders["pytorch"]).save_pretrained(folder)
    assert vaswani_cli(["chat", str(folder), "--prompt", "Hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "'fill-mask' model" in captured.err and "text-generation" in captured.err


def test_bad_flags_are_argparse_errors(folders, capsys: pytest.CaptureFixture) -> None:
    for flags in (["--max-new-tokens", "0"], ["--temperature", "-1"], ["--seed", "3"], ["--top-p", "1.5"]):
        with pytest.raises(SystemExit) as exit_info:
            vaswani_cli(["chat", str(folders["pytorch"]), "--prompt", "Hi", *flags])
        assert exit_info.value.code == 2
    errors = capsys.readouterr().err
    assert "--seed applies to sampling: add --temperature" in errors and "--top-p must be in (0, 1]" in errors


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("form", ["pytorch", "onnx"])
def test_json_schema_answers_are_the_servers_json(folders, form: str, tmp_path: Path, capsys) -> None:
    """`--json-schema FILE`: the answer validates (jsonschema, the independent oracle) and is the answer `vaswani
    serve` gives the same request with `response_format` json_schema, on either form of the folder."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    httpx = pytest.importorskip("httpx")
    import json

    from serving_cases import serving

    from vaswani.serving import create_app, load_service

    schema_file = tmp_path / "person.schema.json"
    schema_file.write_text(json.dumps(PERSON))
    flags = [str(folders[form]), "--prompt", "Describe a person.", "--json-schema", str(schema_file)]
    assert vaswani_cli(["chat", *flags, "--max-new-tokens", "120"]) == 0
    answer = capsys.readouterr().out.removesuffix("\n")
    jsonschema.validate(json.loads(answer), PERSON)
    service = load_service(folders["onnx"], threads=1)
    body = {
        "model": service.name,
        "messages": [{"role": "user", "content": "Describe a person."}],
        "max_tokens": 120,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    }
    with serving(create_app(service)) as server:
        served = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert served["choices"][0]["message"]["content"] == answer


def test_a_schema_that_cannot_be_enforced_is_refused(folders, tmp_path: Path, capsys) -> None:
    pytest.importorskip("llguidance")
    schema_file = tmp_path / "conditional.schema.json"
    schema_file.write_text('{"type": "object", "if": {"required": ["a"]}}')
    flags = [str(folders["onnx"]), "--prompt", "Hi", "--json-schema", str(schema_file)]
    assert vaswani_cli(["chat", *flags]) == 2
    assert 'cannot be enforced: Unimplemented keys: ["if"]' in capsys.readouterr().err
