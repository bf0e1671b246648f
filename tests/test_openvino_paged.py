"""The paged batch `vaswani serve --engine openvino` runs (`decoders/paged.py`): the portable graph in OpenVINO's
paged-attention form, each sequence's cache in blocks of shared tensors. Oracle: ONNX Runtime running the same graph
over each row's whole sequence at once, in float32, within the exporter's fp32 rule; the pool's block accounting is
checked against the blocks each row's length needs."""

import gc
import logging
import math
import threading

import numpy as np
import pytest
import torch
from conftest import tiny_decoder_config
from serving_cases import scheduled_results

from vaswani import VaswaniForCausalLM

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

from vaswani.export import export_onnx  # noqa: E402
from vaswani.export.report import TOLERANCES, allowed_difference  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM  # noqa: E402
from vaswani.runtime.decoders import paged  # noqa: E402
from vaswani.runtime.decoders.openvino import OpenVinoStepModel  # noqa: E402

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    """Portable fp32 exports of a tiny grouped-query decoder (head_dim 16), one per position kind (and, as
    "<kind> source", the PyTorch folder each came from)."""
    root = tmp_path_factory.mktemp("paged")
    made = {}
    for positions in ("rope", "learned", "alibi"):
        torch.manual_seed(0)
        source = root / positions
        config = tiny_decoder_config(position_embedding_type=positions, **SHAPE)
        VaswaniForCausalLM(config).eval().save_pretrained(source)
        made[f"{positions} source"] = source
        made[positions] = export_onnx(source, root / f"{positions}-onnx", task="text-generation", validate=False).folder
    return made


def whole_sequence_logits(model: OrtModelForCausalLM, prompt: list[int], answer: list[int]) -> np.ndarray:
    """ONNX Runtime's logits at the prompt's last token and at every answer token but the last: (len(answer), vocab),
    what the batch returned for that row one call at a time."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + answer[:-1]])).logits[0].numpy()
    return logits[len(prompt) - 1 :]


def greedy_answer(step, group, steps: int) -> tuple[object, list[np.ndarray], list[int]]:
    """A one-row prefill's last logits and `steps` greedy decoding steps after it in a new batch: the batch, the
    logits of each step and the tokens chosen."""
    logits = [group.run(group.columns)[0]]
    batch = step.new_batch()
    batch.join(group, [0])
    answer = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(batch.step(np.array(answer[-1:]))[0])
        answer.append(int(logits[-1].argmax()))
    return batch, logits, answer


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_paged_rows_join_leave_share_a_prefix_and_grow_the_pool_as_onnxruntime_computes(
    positions, folders, monkeypatch
):
    """Three rows at different lengths: one prefilled in chunks across block boundaries, then decoding; two more join
    mid-stream, one starting from the first row's cached first 32 tokens (the server's prefix cache) and one shorter
    than a block; the first leaves; the rest decode past the pool's first size, which doubles twice. Every row's
    logits equal ONNX Runtime's over that row's whole sequence (fp32 rule), greedy tokens included; every block the
    rows held is free once they leave, and a prefill dropped before joining gives its blocks back."""
    monkeypatch.setattr(paged, "FIRST_POOL_BYTES", 0)
    monkeypatch.setattr(paged, "FIRST_BLOCKS", 2)
    model = OrtModelForCausalLM.from_pretrained(folders[positions], engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model(kv_cache_dtype="float32")
    assert isinstance(step, paged.PagedStepModel)
    pool = step.pool
    generator = torch.Generator().manual_seed(3)
    prompts = {name: torch.randint(3, 60, (length,), generator=generator).tolist() for name, length in
               {"a": 40, "b": 45, "c": 5}.items()}  # fmt: skip
    answers = {name: [] for name in prompts}
    seen = {name: [] for name in prompts}

    def choose(names: list, logits: np.ndarray) -> None:
        for name, row in zip(names, logits):
            answers[name].append(int(row.argmax()))
            seen[name].append(row)

    def decode(steps: int) -> None:
        for _ in range(steps):
            choose(batch.rows, batch.step(np.array([answers[name][-1] for name in batch.rows])))

    batch = step.new_batch()
    first = step.prefill_group(["a"], [prompts["a"]])
    while not first.done:
        logits = first.run(16)
    choose(["a"], logits)
    batch.join(first, [0])
    decode(3)
    kept = batch.row_cache(0, 0, 32)  # as the prefix cache keeps it: a's first block, held once more
    assert kept == batch.states[0].blocks[0] and pool.references[kept] == 2
    prompts["b"] = prompts["a"][:32] + prompts["b"]
    prefix = step.prefix_storage.prefix([kept], 32)
    group = step.prefill_group(["b", "c"], [prompts["b"], prompts["c"]], [prefix, None])
    del prefix
    assert group.states[0].blocks[0] == kept  # shared, not copied
    assert group.tokens == 45 + 5  # only the rests are computed
    chunks = []
    while not group.done:
        logits = group.run(20)
        chunks.append(group.computed)
    assert chunks == [40, 50]  # 20 x 2 rows of tokens a call: b's first 40, then b's last 5 and c's 5
    choose(group.rows, logits)
    batch.join(group, [0, 1])
    decode(4)
    batch.keep([1, 2])  # "a" leaves
    assert batch.rows == ["b", "c"]
    decode(60)
    assert pool.blocks >= 8  # grown from 2

    held = {name: len(prompts[name]) + len(answers[name]) - 1 for name in batch.rows}  # the last token is not fed
    assert sorted(len(state.blocks) for state in batch.states) == sorted(
        math.ceil(tokens / pool.block_size) for tokens in held.values()
    )
    alone = OrtModelForCausalLM.from_pretrained(folders[positions])
    kind, tolerance = TOLERANCES["fp32"]
    for name, prompt in prompts.items():
        expected = whole_sequence_logits(alone, prompt, answers[name])
        allowed = allowed_difference(kind, tolerance, float(np.abs(expected).max()), model.config.num_hidden_layers)
        assert float(np.abs(np.stack(seen[name]) - expected).max()) <= allowed, name
        assert answers[name] == expected.argmax(-1).tolist(), name

    batch.keep([])
    assert pool.references[kept] == 1  # a and b have left; the prefix cache's hold remains
    step.prefix_storage.release(kept)
    dropped = step.prefill_group(["d"], [prompts["a"]])
    dropped.run(8)
    assert len(pool.free) == pool.blocks - math.ceil(len(prompts["a"]) / pool.block_size)
    del dropped
    gc.collect()
    assert len(pool.free) == pool.blocks


def test_the_prefix_cache_keeps_the_pools_own_blocks_and_a_prefix_ending_inside_one_copies_it(folders):
    """The server's prefix cache over the paged batch keeps the pool's blocks themselves: storing a prompt copies
    nothing (its partial last block included), and a later prompt starts from the very blocks. A prompt cached whole
    (all but its last token) ends inside a whole block, and a prompt that goes on past the cached one's partial last
    block ends inside that one: each copies the block it ends inside and writes in its own. Their logits and greedy
    tokens are ONNX Runtime's over the whole sequence, and the cached blocks are unchanged. Blocks leave the pool
    only when no row and not the cache holds them."""
    from functools import partial

    from vaswani.serving.prefix_cache import PrefixCache

    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")
    reference = OrtModelForCausalLM.from_pretrained(folders["rope"])
    kind, tolerance = TOLERANCES["fp32"]
    step = model.decoder_runtime.step_model(kv_cache_dtype="float32")
    pool = step.pool
    cache = PrefixCache.for_model(step, 1 << 30)
    assert cache.block_size == pool.block_size == 32
    prompt = torch.randint(3, 60, (70,), generator=torch.Generator().manual_seed(9)).tolist()

    first = step.prefill_group(["a"], [prompt])
    first.run(first.columns)
    assert cache.store(prompt, partial(first.row_cache, 0)) == 3  # two whole blocks and the 6 tokens of a third
    kept = list(first.states[0].blocks)
    assert sorted(block.kept for block in cache.blocks.values()) == sorted(kept)  # the row's own blocks, not copies
    before = [array[kept].copy() for array in pool.arrays]
    first.keep([])  # the row is dropped: the cache's hold keeps its blocks
    held = {block for block in range(pool.blocks) if pool.references[block]}
    assert held == set(kept)

    longer = prompt + [7, 8, 9]
    for resumed, cached_tokens, own_block in ((prompt[:64], 63, 1), (longer, 70, 2)):
        cached, prefix = cache.lookup(resumed)
        assert cached == cached_tokens
        group = step.prefill_group(["r"], [resumed], [prefix])
        del prefix
        blocks = group.states[0].blocks
        assert group.tokens == len(resumed) - cached and blocks[:own_block] == kept[:own_block]
        assert blocks[own_block] != kept[own_block]  # the block its cached part ends inside: copied
        batch, logits, answer = greedy_answer(step, group, 5)
        expected = whole_sequence_logits(reference, resumed, answer)
        allowed = allowed_difference(kind, tolerance, float(np.abs(expected).max()), model.config.num_hidden_layers)
        assert float(np.abs(np.stack(logits) - expected).max()) <= allowed
        assert answer == expected.argmax(-1).tolist()
        for array, saved in zip(pool.arrays, before):
            np.testing.assert_array_equal(array[kept], saved)
        batch.keep([])
        assert {block for block in range(pool.blocks) if pool.references[block]} == set(kept)

    assert cache.make_room(cache.max_bytes, set())  # evicts every block
    assert len(pool.free) == pool.blocks and not any(pool.references)

    from vaswani.serving.scheduler import Scheduler

    with pytest.raises(ValueError, match=r"PrefixCache\.for_model\(step_model\)"):
        Scheduler(step, prefix_cache=PrefixCache(1 << 20))  # a cache of copies cannot start the paged batch's rows


def test_paged_verification_and_rollback_continue_as_plain_decoding(folders):
    """Speculation's two operations on the paged batch: two rows each fed their last token and 3 proposals in one
    call give ONNX Runtime's logits at every fed position; rolling back the rejected ones (2 and 0) leaves each row
    where plain decoding of its kept tokens would be, and the next step's logits are ONNX Runtime's for that."""
    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model(kv_cache_dtype="float32")
    alone = OrtModelForCausalLM.from_pretrained(folders["rope"])
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 60, (length,), generator=generator).tolist() for length in (30, 9)]
    group = step.prefill_group(["x", "y"], prompts)
    firsts = group.run(group.columns).argmax(-1).tolist()
    batch = step.new_batch()
    batch.join(group, [0, 1])
    proposals = [[11, 12, 13], [21, 22, 23]]
    fed = [[first, *more] for first, more in zip(firsts, proposals)]
    verified = batch.verify(fed)
    batch.rollback([2, 0])
    kept = [prompts[0] + fed[0][:2], prompts[1] + fed[1]]
    following = batch.step(np.array([40, 41]))
    kind, tolerance = TOLERANCES["fp32"]
    for row in range(2):
        with torch.no_grad():
            expected = alone(input_ids=torch.tensor([prompts[row] + fed[row]])).logits[0, len(prompts[row]) :].numpy()
            after = alone(input_ids=torch.tensor([kept[row] + [40 + row]])).logits[0, -1].numpy()
        allowed = allowed_difference(kind, tolerance, float(np.abs(expected).max()), model.config.num_hidden_layers)
        assert float(np.abs(verified[row] - expected).max()) <= allowed
        assert float(np.abs(following[row] - after).max()) <= allowed


def test_a_graph_without_position_ids_is_served_by_the_stateful_batch_and_the_log_says_why(folders, caplog):
    """An ALiBi decoder's graph takes no position_ids, which the paged form needs: the server's step model is the
    stateful batch, and the log names the reason."""
    model = OrtModelForCausalLM.from_pretrained(folders["alibi"], engine="openvino", openvino_precision="f32")
    with caplog.at_level(logging.INFO, logger="vaswani.runtime.decoders.openvino"):
        step = model.decoder_runtime.step_model()
    assert isinstance(step, OpenVinoStepModel)
    assert "stateful batch" in caplog.text and "position_ids" in caplog.text


def test_only_a_graph_the_paged_form_refuses_falls_back_to_the_stateful_batch(folders, monkeypatch):
    """Any other failure to build the paged batch is raised, not served around: a pool OpenVINO refuses to bind (as
    it refused float16 blocks at bf16 compute, which left every bfloat16 CPU on the slower stateful batch unseen)."""
    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")

    def refused(self, blocks):
        raise RuntimeError("ParameterMismatch: Failed to set tensor")

    monkeypatch.setattr(paged.BlockPool, "grow", refused)
    with pytest.raises(RuntimeError, match="ParameterMismatch"):
        model.decoder_runtime.step_model()


def test_the_route_reads_the_graph_once_and_opens_onnxruntime_only_for_a_call_left_to_it(folders, monkeypatch, caplog):
    """Memory: OpenVINO's ONNX reader holds a quantized graph's weights in memory, and each compiled model and ONNX
    Runtime session holds its own copy. The route reads the graph once (the server's paged form transforms a copy of
    it, which shares the weights), and ONNX Runtime opens its session at the first call OpenVINO does not run (a
    one-token `forward`), once: the paged batch and `generate` need none. That call's logits are ONNX Runtime's own
    (the oracle: the same folder loaded by the default engine)."""
    import onnxruntime
    import openvino

    reads, sessions = [], []
    read_model, session_class = openvino.Core.read_model, onnxruntime.InferenceSession

    def counted_read(core, *args, **kwargs):
        reads.append(args[0])
        return read_model(core, *args, **kwargs)

    class CountedSession(session_class):
        def __init__(self, path, *args, **kwargs):
            sessions.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(openvino.Core, "read_model", counted_read)
    monkeypatch.setattr(onnxruntime, "InferenceSession", CountedSession)
    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model()
    assert isinstance(step, paged.PagedStepModel)
    greedy_answer(step, step.prefill_group([0], [[5, 6, 7, 8]]), 3)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(reads) == 1 and sessions == []
    one_token = torch.tensor([[7]])
    with caplog.at_level(logging.INFO, logger="vaswani.runtime.session"):
        logits = [model(input_ids=one_token).logits for _ in range(2)]
    assert len(sessions) == 1 and "ONNX Runtime opens model.onnx now" in caplog.text
    monkeypatch.undo()
    expected = OrtModelForCausalLM.from_pretrained(folders["rope"])(input_ids=one_token).logits
    for got in logits:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_kv_cache_types_follow_what_openvinos_paged_attention_takes_at_each_compute_precision():
    """"auto" is the compute precision's 16-bit type; a type the kernel does not take there is refused with the
    types it takes and the precision that would take it."""
    assert paged.kv_cache_type("auto", "f32") == "f16" and paged.kv_cache_type("float32", "f32") == "f32"
    assert paged.kv_cache_type("auto", "bf16") == "bf16" == paged.kv_cache_type("bfloat16", "bf16")
    with pytest.raises(ValueError, match="'float32' is not available at OpenVINO's bf16 compute.*'auto', 'bfloat16'"):
        paged.kv_cache_type("float32", "bf16")
    with pytest.raises(ValueError, match="--openvino-precision bf16"):
        paged.kv_cache_type("bfloat16", "f32")


@pytest.mark.skipif(
    "BF16" not in __import__("openvino").Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"),
    reason="OpenVINO computes bf16 natively only on CPUs with AVX512_BF16 or AMX",
)
def test_bf16_compute_serves_the_paged_batch_with_a_bfloat16_cache(folders):
    """At bf16 compute (what "auto" picks on CPUs with bfloat16) the step model is the paged batch, its pool in
    bfloat16, the one type OpenVINO's paged attention takes there. Its logits, prefill and decoding steps, are within
    the half-precision rule of the PyTorch model's in bfloat16 over the same tokens (3x that model's own bfloat16
    error against its float32 logits)."""
    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="bf16")
    step = model.decoder_runtime.step_model()
    assert isinstance(step, paged.PagedStepModel) and step.pool.cache_type == "bf16"
    assert step.description.endswith("paged graph (bf16), the KV cache in bf16 blocks")
    with pytest.raises(ValueError, match="openvino_precision='f32'"):
        model.decoder_runtime.step_model(kv_cache_dtype="float32")
    prompt = torch.randint(3, 60, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    _, logits, answer = greedy_answer(step, step.prefill_group(["x"], [prompt]), 12)
    source = VaswaniForCausalLM.from_pretrained(folders["rope source"]).eval()
    ids = torch.tensor([prompt + answer[:-1]])
    with torch.no_grad():
        float32 = source(input_ids=ids).logits[0, len(prompt) - 1 :]
        bfloat16 = source.to(torch.bfloat16)(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    own_error = float((bfloat16 - float32).abs().max())
    kind, tolerance = TOLERANCES["fp16"]
    depth = source.config.num_hidden_layers
    allowed = allowed_difference(kind, tolerance, float(float32.abs().max()), depth, own_error)
    difference = float(np.abs(np.stack(logits) - bfloat16.numpy()).max())
    assert difference <= allowed, (difference, allowed)


def test_a_prompt_joins_the_batch_when_its_own_prefill_ends_not_its_groups(folders, monkeypatch):
    """A short and a long prompt submitted together are prefilled as one group under a small token budget: the short
    one joins the batch, and decodes, while the long one's chunks still go in (iterations of the scheduler's own step
    log that both fed prompt tokens and decoded a row: each of the long prompt's chunks after the short one's), every
    call but the last computes the whole budget, decoded rows and prompt tokens together, and each answer is the one
    a scheduler that waits for the whole group gives (f32: the same tokens). With the group waiting, no iteration
    does both (its rows decode from the iteration after its last chunk), so the check can fail."""
    from vaswani.serving import SamplingParams
    from vaswani.serving.scheduler import Scheduler

    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model()
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 60, (length,), generator=generator).tolist() for length in (8, 120)]
    requests = [(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for prompt in prompts]

    def served() -> tuple[list[list[int]], int]:
        scheduler = Scheduler(step, max_batch=4, max_num_batched_tokens=32)
        results = scheduled_results(scheduler, requests)
        overlapping = sum(1 for fed, decoded in scheduler.step_log if fed and decoded)
        chunks = [fed + decoded for fed, decoded in scheduler.step_log if fed]
        assert sum(chunks) >= 128 and set(chunks[:-1]) == {32}, chunks  # the whole budget, but for the last chunk
        return [tokens for tokens, _, _ in results], overlapping

    early, overlapping = served()
    monkeypatch.setattr(paged.PagedPrefill, "take_finished", lambda self: None)
    waiting, none = served()
    assert overlapping >= 4 and none == 0, (overlapping, none)
    assert early == waiting and all(len(tokens) == 6 for tokens in early)


def test_a_prompt_arriving_mid_prefill_joins_the_group_and_every_call_fills_the_budget(folders, monkeypatch):
    """A short prompt submitted while a long one is being prefilled joins its group (`PagedPrefill.extend`), so every
    call feeds the scheduler's whole token budget until both are in: 4 calls of 32 for 120 + 8 tokens, the scheduler's
    own step log, where a scheduler whose group takes no newcomers needs 5 (32, 32, 32, 24, then 8 in a group of its
    own). The answers are that scheduler's (f32: the same tokens). Driven an iteration at a time, as the scheduler's
    thread runs them, so that the arrival lands after the first call."""
    from vaswani.serving import SamplingParams
    from vaswani.serving.scheduler import Scheduler

    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model()
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 60, (length,), generator=generator).tolist() for length in (120, 8)]

    def served() -> tuple[list[list[int]], list[tuple[int, int]]]:
        scheduler = Scheduler(step, max_batch=4, max_num_batched_tokens=32)
        answers = [[], []]
        ended = []

        def submit(index: int) -> None:
            def emit(event):
                answers[index].append(event.token)
                if event.finish_reason:
                    ended.append(index)

            scheduler.submit(prompts[index], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), emit)

        submit(0)
        for iteration in range(40):
            scheduler._schedule_waiting()
            scheduler._iteration()
            if iteration == 0:
                submit(1)
            if len(ended) == 2:
                break
        prefill = [entry for entry in scheduler.step_log if entry[0]]
        return answers, prefill

    joined, joined_calls = served()
    monkeypatch.setattr(Scheduler, "_extend_group", lambda self, group: None)
    apart, apart_calls = served()
    assert joined_calls == [(32, 0)] * 4, joined_calls
    assert [fed for fed, _ in apart_calls] == [32, 32, 32, 24, 8], apart_calls
    assert joined == apart and all(len(tokens) == 6 for tokens in joined)


def test_a_failing_fused_step_runs_the_chunk_and_the_step_apart(folders, monkeypatch, caplog):
    """Where the one call of a decoding step and a prompt chunk fails, the scheduler logs it and runs the two apart
    (so a bad prompt would fail only its own requests): every answer is still the one the fused steps give."""
    from vaswani.serving import SamplingParams
    from vaswani.serving.scheduler import Scheduler

    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model()
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 60, (length,), generator=generator).tolist() for length in (12, 90)]

    def answers() -> list[list[int]]:
        scheduler = Scheduler(step, max_batch=4, max_num_batched_tokens=16).start()
        try:
            results = [[] for _ in prompts]
            first = scheduler.submit(prompts[0], SamplingParams(max_tokens=40, temperature=0), results[0].append)
            while len(results[0]) < 2:  # the first stream runs before the long prompt arrives
                threading.Event().wait(0.01)
            scheduler.submit(prompts[1], SamplingParams(max_tokens=8, temperature=0), results[1].append)
            while not all(result and result[-1].finish_reason for result in results):
                threading.Event().wait(0.01)
            assert first.finished
        finally:
            scheduler.stop()
        return [[event.token for event in result] for result in results]

    fused = answers()
    failures = []

    def failing(self, tokens, group, prompt_tokens):
        failures.append(prompt_tokens)
        raise RuntimeError("a fused call that fails")

    monkeypatch.setattr(paged.PagedBatch, "step_with_prefill", failing)
    with caplog.at_level(logging.ERROR, logger="vaswani.serving.scheduler"):
        apart = answers()
    assert failures and "running the two apart" in caplog.text
    assert apart == fused


def test_a_float16_cache_halves_the_pool_and_keeps_onnxruntimes_tokens(folders, caplog):
    """The default cache (`kv_cache_dtype="auto"`, as `vaswani serve` starts) is float16 at f32 compute too, and the
    log says so: the pool's tensors are float16, half the bytes a block of `--kv-cache-dtype float32`'s, and greedy
    tokens stay ONNX Runtime's with logits within the half-precision rule."""
    model = OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino", openvino_precision="f32")
    with caplog.at_level(logging.INFO, logger="vaswani.runtime.decoders.paged"):
        half = model.decoder_runtime.step_model()
    assert "paged KV cache in f16 (kv_cache_dtype=auto)" in caplog.text
    full = model.decoder_runtime.step_model(kv_cache_dtype="float32")
    assert half.pool.arrays[0].dtype == np.float16 and full.pool.arrays[0].dtype == np.float32
    assert model.decoder_runtime.step_model(kv_cache_dtype="float16").pool.arrays[0].dtype == np.float16
    assert 2 * half.pool.bytes_per_block == full.pool.bytes_per_block
    prompt = torch.randint(3, 60, (50,), generator=torch.Generator().manual_seed(8)).tolist()
    group = half.prefill_group(["x"], [prompt])
    _, logits, answer = greedy_answer(half, group, 20)
    expected = whole_sequence_logits(OrtModelForCausalLM.from_pretrained(folders["rope"]), prompt, answer)
    assert answer == expected.argmax(-1).tolist()
    kind, tolerance = TOLERANCES["fp16"]
    allowed = allowed_difference(kind, tolerance, float(np.abs(expected).max()), model.config.num_hidden_layers)
    assert float(np.abs(np.stack(logits) - expected).max()) <= allowed


def test_the_paged_batchs_options_are_refused_where_the_batch_is_not_openvinos(folders):
    """`--kv-cache-dtype` and `--openvino-int8-activations off` name the flag and the engine they need where the
    server runs ONNX Runtime; an unknown cache precision names the choices."""
    from vaswani.serving import load_service

    with pytest.raises(ValueError, match="--kv-cache-dtype.*engine='openvino'.*Leave it at its default"):
        load_service(folders["rope"], kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="openvino_int8_activations=False .--openvino-int8-activations. sets"):
        load_service(folders["rope"], openvino_int8_activations=False)
    with pytest.raises(ValueError, match="not supported; use one of"):
        OrtModelForCausalLM.from_pretrained(folders["rope"], engine="openvino").decoder_runtime.step_model(
            kv_cache_dtype="int8"
        )


def test_an_unknown_kv_cache_dtype_is_refused_before_the_model_loads(tmp_path):
    """`load_service` names the choices before reading the folder (an empty one here)."""
    from vaswani.serving import load_service

    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported; use one of"):
        load_service(tmp_path, engine="openvino", kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def int8_folder(tmp_path_factory) -> object:
    """The portable int8 export of a 2-layer decoder 1024 wide: matrices large enough that OpenVINO's CPU plugin
    keeps them compressed and rounds their products' activations to int8 in calls of several tokens (at 512 wide it
    computed them in float on the machine this was written on)."""
    root = tmp_path_factory.mktemp("paged-int8")
    torch.manual_seed(0)
    shape = dict(hidden_size=1024, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4)
    config = tiny_decoder_config(position_embedding_type="rope", max_position_embeddings=256, **shape)
    VaswaniForCausalLM(config).eval().save_pretrained(root / "source")
    return export_onnx(
        root / "source", root / "int8", task="text-generation", quantize="int8", attention="portable", validate=False
    ).folder


def test_float_activations_make_answers_independent_of_the_rows_sharing_a_step(int8_folder):
    """`int8_activations=False` (`vaswani serve --openvino-int8-activations off`) tells the plugin not to round the
    int8 weights' products' activations to int8 (read back). Then each of four prompts gets the same greedy tokens
    decoded alone (one-row steps) as decoded together (four-row steps), and greedy speculation (verification calls of
    several tokens a row) serves those tokens too. With the plugin's default, one of the four answers parts from its
    one-row decoding after 25 tokens on an AVX-512 VNNI Xeon (where the plugin rounds; a CPU where it does not would
    not show it), so the comparison can fail."""
    from vaswani.serving import SamplingParams
    from vaswani.serving.scheduler import Scheduler
    from vaswani.serving.speculation import SpeculativeConfig, Speculator

    model = OrtModelForCausalLM.from_pretrained(int8_folder, engine="openvino", openvino_precision="f32")
    step = model.decoder_runtime.step_model(int8_activations=False)
    assert int(step.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 0
    assert int(model.decoder_runtime.step_model().compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) != 0
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 64, (length,), generator=generator).tolist() for length in (40, 23, 31, 12)]

    def answers(rows: int, speculator=None) -> list[list[int]]:
        requests = [(prompt, SamplingParams(max_tokens=40, temperature=0.0)) for prompt in prompts]
        found = []
        for start in range(0, len(requests), rows):
            scheduler = Scheduler(step, max_batch=rows, speculator=speculator)
            found += [tokens for tokens, _, _ in scheduled_results(scheduler, requests[start : start + rows])]
        return found

    alone = answers(1)
    assert answers(4) == alone
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=None))
    assert answers(4, speculator) == alone
    assert speculator.draft_tokens > 0
