"""The decoder runtime registry (`vaswani.runtime.decoders`) and the task registry (`vaswani.runtime.class_for_task`).

A runtime registered from outside the package, without editing any vaswani file, is chosen by its `engine=` and is
what both `generate()` and the server's scheduler run: the registry, not an `isinstance` ladder, decides. Oracles:
PyTorch's `generate` on the model the export came from; the tokens of the built-in portable runtime; the calls the
toy runtime counts. Also: which built-in runtime an export gets and the refusal it gets where none fits, the task ->
class mapping read from the classes' own `tasks`, and the runtime's import graph (no circle, nothing imported from
above it)."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_cases import offline_answer, scheduled_tokens, tiny_chat_folders, tiny_chat_tokenizer

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter's dependency

from vaswani import VaswaniForCausalLM  # noqa: E402
from vaswani.runtime import (  # noqa: E402
    DECODER_RUNTIMES,
    OrtModel,
    OrtModelForCausalLM,
    OrtModelForMaskedLM,
    OrtModelForSeq2SeqLM,
    class_for_task,
    default_session_options,
    register_decoder_runtime,
)
from vaswani.runtime.decoders import LoadRequest, choose_decoder_runtime, chosen_engine, engines  # noqa: E402
from vaswani.runtime.decoders.gqa import GqaRuntime  # noqa: E402
from vaswani.runtime.decoders.portable import OrtStepModel, PortableRuntime, RunningBatch  # noqa: E402
from vaswani.serving import SamplingParams, load_service  # noqa: E402

RUNTIME_ROOT = Path(__file__).resolve().parents[1] / "vaswani" / "runtime"


# ------------------------------------------------------------------ a toy runtime, registered from a test


class CountingBatch(RunningBatch):
    """The portable runtime's left-padded batch, counting the decode steps it ran."""

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.model.runtime.batch_steps += 1
        return super().step(tokens)


class CountingStepModel(OrtStepModel):
    """The toy runtime's step model: its own batch kind (`CountingBatch`)."""

    def __init__(self, model, runtime: "CountingRuntime"):
        super().__init__(model)
        self.runtime = runtime

    def new_batch(self) -> CountingBatch:
        return CountingBatch(self)


class CountingRuntime(PortableRuntime):
    """ONNX Runtime on the portable graph, as the portable runtime runs it, counting every graph call; asked for with
    `engine="counting"`. This class is all a new runtime needs: one class, one registration."""

    name = "counting"
    engine = "counting"
    title = "the counting runtime"
    auto_reason = "never: a test's runtime"

    @classmethod
    def auto_refusal(cls, manifest: dict, provider: str) -> str | None:
        return "a test's runtime is only run when asked for"

    def __init__(self, model):
        super().__init__(model)
        self.graph_calls = self.batch_steps = 0

    @property
    def description(self) -> str:
        return "every step counted"

    def run(self, inputs, past, buffers):
        self.graph_calls += 1
        return super().run(inputs, past, buffers)

    def run_arrays(self, inputs, past):
        self.graph_calls += 1
        return super().run_arrays(inputs, past)

    def step_model(self) -> CountingStepModel:
        return CountingStepModel(self.model, self)


@pytest.fixture
def counting():
    """The toy runtime registered for one test (the registry as it was afterwards)."""
    register_decoder_runtime(CountingRuntime)
    yield CountingRuntime
    del DECODER_RUNTIMES[CountingRuntime.name]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny chat model: its PyTorch folder, its portable ONNX export, and the tokenizer."""
    tokenizer = tiny_chat_tokenizer()
    torch_folder, onnx_folder = tiny_chat_folders(tmp_path_factory.mktemp("runtimes"), tokenizer)
    return torch_folder, onnx_folder, tokenizer


PORTABLE = {"task": "text-generation", "attention_form": "portable"}
GQA = {"task": "text-generation", "attention_form": "gqa"}


def left_padded(rows: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    length = max(rows)
    ids = torch.randint(3, vocab, (len(rows), length), generator=generator)
    mask = (torch.arange(length)[None] >= length - torch.tensor(rows)[:, None]).long()
    return ids * mask, mask


def test_an_unregistered_engine_is_refused_with_the_choices():
    assert "counting" not in engines()
    with pytest.raises(ValueError, match=r"engine='counting' is not supported; use one of \['onnxruntime'"):
        choose_decoder_runtime("counting", LoadRequest(Path("x"), {"task": "text-generation"}, "CPUExecutionProvider"))


@pytest.mark.parametrize("loop", ["lean", "transformers"])
def test_generate_runs_on_a_registered_toy_runtime(loop, counting, chat):
    """`engine="counting"` loads the toy runtime; `generate` on a left-padded batch gives PyTorch's greedy tokens,
    every graph call through the toy's `run`: the lean loop's prompt and one step per later token, or transformers'
    loop through `forward`."""
    torch_folder, onnx_folder, tokenizer = chat
    assert "counting" in engines()
    model = OrtModelForCausalLM.from_pretrained(
        onnx_folder, session_options=default_session_options(1), engine="counting"
    )
    runtime = model.decoder_runtime
    assert type(runtime) is CountingRuntime and model.provider == "CPUExecutionProvider"
    model.fast_generation = loop == "lean"
    ids, mask = left_padded([7, 4], len(tokenizer))
    options = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    tokens = model.generate(ids, **options)
    with torch.inference_mode():
        expected = VaswaniForCausalLM.from_pretrained(torch_folder).eval().generate(ids, **options)
    assert torch.equal(tokens, expected)
    assert runtime.graph_calls == 6  # the prompt, then one call for each of the 5 later tokens


def test_the_scheduler_runs_a_registered_toy_runtimes_own_batch(counting, chat):
    """`load_service(engine="counting")` serves with the toy runtime's step model and batch kind: two greedy prompts
    decoded together get PyTorch's answers to each alone, and every decode step ran in the toy's batch."""
    torch_folder, onnx_folder, tokenizer = chat
    service = load_service(onnx_folder, threads=1, engine="counting")
    step_model = service.scheduler.model
    assert type(step_model) is CountingStepModel and service.description == "every step counted"
    prompts = [tokenizer("Once upon a time")["input_ids"], tokenizer("The little cat")["input_ids"]]
    answers = scheduled_tokens(service.scheduler, [(prompt, SamplingParams(max_tokens=8, temperature=0)) for prompt in prompts])
    pytorch_model = VaswaniForCausalLM.from_pretrained(torch_folder).eval()
    assert answers == [offline_answer(pytorch_model, tokenizer, prompt, 8)[1] for prompt in prompts]
    assert step_model.runtime.batch_steps > 0 and step_model.runtime.graph_calls > step_model.runtime.batch_steps


def test_engine_auto_asks_a_registered_runtime_and_logs_why_not(counting, caplog):
    """ "auto" asks every runtime of an engine other than ONNX Runtime (here OpenVINO declines the GroupQueryAttention
    form, then the toy declines too), logs each reason, and falls back to ONNX Runtime."""
    caplog.set_level("INFO", logger="vaswani.runtime.decoders")
    assert chosen_engine("auto", GQA, "CPUExecutionProvider") == "onnxruntime"
    messages = [record.getMessage() for record in caplog.records if record.name == "vaswani.runtime.decoders"]
    assert (
        messages[-1]
        == "engine='auto' runs ONNX Runtime, not the counting runtime: a test's runtime is only run when asked for"
    )


# ------------------------------------------------------------------ the built-in runtimes' choice


@pytest.mark.parametrize(
    "manifest, engine, expected",
    [(PORTABLE, "onnxruntime", PortableRuntime), ({"task": "text-generation"}, "onnxruntime", PortableRuntime)]
    + [(GQA, "onnxruntime", GqaRuntime)],
)
def test_each_export_gets_the_runtime_of_its_form(manifest, engine, expected):
    """A folder exported before the manifest named its form is portable; the GroupQueryAttention form gets its own."""
    request = LoadRequest(Path("folder"), manifest, "CPUExecutionProvider")
    assert choose_decoder_runtime(engine, request) is expected


@pytest.mark.parametrize(
    "manifest, engine, provider, match",
    [
        (GQA, "onnxruntime", "CUDAExecutionProvider", "runs on the CPU only.*--attention portable"),
        (GQA, "openvino", "CPUExecutionProvider", "only ONNX Runtime runs.*--attention portable"),
        (PORTABLE, "openvino", "CUDAExecutionProvider", "runs text-generation exports on the CPU"),
    ],
)
def test_an_export_no_runtime_of_the_engine_runs_is_refused_with_the_fix(manifest, engine, provider, match):
    with pytest.raises(ValueError, match=match):
        choose_decoder_runtime(engine, LoadRequest(Path("folder"), manifest, provider))


# ------------------------------------------------------------------ the task registry


def test_each_task_maps_to_the_class_that_names_it():
    assert class_for_task("text-generation") is OrtModelForCausalLM
    assert class_for_task("fill-mask") is OrtModelForMaskedLM
    assert class_for_task("text2text-generation") is OrtModelForSeq2SeqLM
    with pytest.raises(ValueError, match="'fill-mask'.*'text-generation'"):
        class_for_task("image-segmentation")


def test_a_new_class_naming_its_task_is_found_without_a_table():
    """A class is its own registration: subclassing `OrtModel` with `tasks` is all the mapping needs."""

    class OrtModelForToyTask(OrtModel):
        tasks = ("toy-task",)

    assert class_for_task("toy-task") is OrtModelForToyTask


# ------------------------------------------------------------------ the runtime's import graph


def imports_of(path: Path) -> set[str]:
    """The vaswani modules `path` imports, at the top or inside functions (a package's submodules resolved)."""
    package = ["vaswani", *path.relative_to(RUNTIME_ROOT.parent).with_suffix("").parts]
    package = package[:-1]  # a module's package; an __init__'s own
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("vaswani")}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if not module.startswith("vaswani"):
                continue
            found.add(module)
            for alias in node.names:
                candidate = RUNTIME_ROOT.parent.parent.joinpath(*module.split("."), alias.name)
                if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
                    found.add(f"{module}.{alias.name}")
    return found


def test_the_runtime_imports_nothing_above_it_and_has_no_circle():
    """The floors: the runtime imports neither the exporter, quantization, evaluation, serving nor the CLI; and no
    two of its modules import each other, not even through imports inside functions (gqa.py and openvino.py did)."""
    graph = {}
    for path in sorted(RUNTIME_ROOT.rglob("*.py")):
        parts = path.relative_to(RUNTIME_ROOT.parent.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = imports_of(path)
    above = ("vaswani.export", "vaswani.quantization", "vaswani.evaluation", "vaswani.serving", "vaswani.cli")
    upward = {name: sorted(i for i in imported if i.startswith(above)) for name, imported in graph.items()}
    assert not any(upward.values()), upward
    assert "vaswani.runtime.gqa" not in graph["vaswani.runtime.openvino"]
    assert "vaswani.runtime.openvino" not in graph["vaswani.runtime.gqa"]
    visiting, done = set(), set()

    def visit(name: str, path: list[str]) -> None:
        if name in done or name not in graph:
            return
        assert name not in visiting, " -> ".join([*path, name])
        visiting.add(name)
        for imported in graph[name]:
            visit(imported, [*path, name])
        visiting.discard(name)
        done.add(name)

    for name in graph:
        visit(name, [])


def test_runtime_modules_stay_readable_in_one_sitting():
    sizes = {path.name: len(path.read_text().splitlines()) for path in RUNTIME_ROOT.rglob("*.py")}
    assert max(sizes.values()) < 600, sizes
