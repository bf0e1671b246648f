"""What the paged KV cache's precision costs in quality: perplexity of `--engine openvino`'s served decoding path
(`PagedStepModel`, the graph in OpenVINO's paged form) with its cache in float32 and in float16, on the tuning and
the held-out texts of benchmarks/int4_domains.py.

Each text is scored as the server decodes: its first token fed alone, then one token per call, so that every
prediction reads every earlier token's keys and values from the cache in the precision under test (a prompt's
prefill reads its own chunk's keys fresh; a decoding step reads them all back). The same token ids, the same graph
and the same compute precision for both caches; only `kv_cache_dtype` differs. The raw values are saved as
int4_domains.py saves its builds' (the cache precisions are the "builds"), and the page's tables come from
`benchmarks.results.quality.domain_tables`.

    python -m benchmarks.kv_cache_quality --folder /tmp/smol/onnx-int8-attention-portable --max-tokens 512 \\
        --json docs/results/kv_cache_quality.json --markdown docs/results/kv_cache_quality.md

`--precisions f32 bf16` scores each compute precision with each cache type it takes (f32: float32, float16; bf16:
bfloat16), the first the reference: what a decode step's compute precision costs, where a quantized export's
products round their activations to int8 at f32 and compute in bfloat16 at bf16.
"""

import argparse
import math
from pathlib import Path

import numpy as np

from benchmarks.int4_domains import cut, decoder_weight_bytes, describe_build, held_out_texts, tuning_texts
from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import write
from benchmarks.results.quality import HELD_OUT, TUNING

DTYPES = ("float32", "float16")  # the reference first: the page's changes are against it
DTYPES_AT = {"f32": DTYPES, "bf16": ("bfloat16",)}  # the cache types OpenVINO's paged attention takes at each


def decoded_scores(step_model, ids: list[int]) -> tuple[float, np.ndarray]:
    """Teacher-forced decoding of `ids` through `step_model` one token per call: the summed negative log-likelihood
    (nats) of ids[1:], and the token each position predicts (argmax), for agreement between caches."""
    row = step_model.new_row()
    logits = step_model.infer([row], [np.asarray(ids[:1])])[0]
    total, predicted = 0.0, []
    for token in ids[1:]:
        scores = logits.astype(np.float64)
        top = scores.max()
        total += top + math.log(np.exp(scores - top).sum()) - scores[token]
        predicted.append(int(scores.argmax()))
        logits = step_model.infer([row], [np.asarray([token])])[0]
    return total, np.asarray(predicted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", required=True, help="a portable export (vaswani export --attention portable)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens scored per text, from its start")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", choices=sorted(DTYPES_AT), help="compute precisions (default: auto)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from vaswani.runtime.openvino import openvino_precision

    if not args.precisions and len(DTYPES_AT[openvino_precision("auto")]) < 2:
        # The default compares cache types at the engine's own precision; bf16 compute's paged attention takes one.
        parser.error(
            "OpenVINO computes in bf16 on this CPU, and its paged attention takes only a bfloat16 cache there, so "
            "there are no two cache types to compare: pass --precisions f32 (float32 against float16 caches at f32 "
            "compute) or --precisions f32 bf16 (what each compute precision costs)."
        )

    from vaswani.evaluation.perplexity import text_ids
    from vaswani.runtime import OrtModelForCausalLM, default_session_options

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    # (compute precision, cache type) per build: the engine's own precision ("auto") with both cache types by default
    variants = [
        (precision, dtype) for precision in args.precisions or ["auto"] for dtype in DTYPES_AT.get(precision, DTYPES)
    ]
    label = {
        (precision, dtype): f"{dtype} cache" if not args.precisions else f"{precision} compute, {dtype} cache"
        for precision, dtype in variants
    }
    sets = {TUNING: tuning_texts(), HELD_OUT: held_out_texts()}
    texts = {name: cut(text) for chosen in sets.values() for name, text in chosen.items()}
    build = describe_build(args.folder)
    raw = {
        "model": "SmolLM2-135M-Instruct, exported by vaswani export (the manifest says how)",
        "texts": {name: {"set": chosen, "characters": len(texts[name])} for chosen in sets for name in sets[chosen]},
        "builds": {
            label[precision, dtype]: {
                "folder": args.folder,
                "engine": "openvino",
                "openvino_precision": precision,
                "kv_cache_dtype": dtype,
                "weight_bytes": decoder_weight_bytes(args.folder),
                "build": f"{build}, run by --engine openvino's paged batch, openvino_precision={precision}, "
                f"kv_cache_dtype={dtype}",
            }
            for precision, dtype in variants
        },
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "runs": {},
        "agreement": {},
    }
    predictions = {}
    models = {}  # one load per compute precision; each cache type compiles its own paged graph from it
    for precision, dtype in variants:
        if precision not in models:
            models.clear()  # the previous precision's model is done with: free its weights first
            models[precision] = OrtModelForCausalLM.from_pretrained(
                args.folder,
                engine="openvino",
                openvino_precision=precision,
                session_options=default_session_options(args.threads),
            )
        step_model = models[precision].decoder_runtime.step_model(kv_cache_dtype=dtype)
        for name, text in texts.items():
            ids = text_ids(tokenizer, text, args.max_tokens)
            total, predictions[label[precision, dtype], name] = decoded_scores(step_model, ids)
            scored = len(ids) - 1
            raw["runs"].setdefault(label[precision, dtype], {})[name] = {
                "perplexity": math.exp(total / scored), "mean_nll": total / scored, "tokens": scored,
            }  # fmt: skip
            print(f"{label[precision, dtype]} {name}: perplexity {math.exp(total / scored):.3f} over {scored} tokens")
        del step_model
    reference, *others = label.values()
    for name in texts:  # the share of positions whose most likely next token is the same as under the reference
        raw["agreement"][name] = {
            other: float((predictions[reference, name] == predictions[other, name]).mean()) for other in others
        }
    compared = (
        "the compute precision is the engine's default for the export, the same for both caches"
        if not args.precisions
        else "each build computes in the precision it names (at f32 a quantized export's products round their "
        "activations to int8 in groups of 32; at bf16 they compute in bfloat16)"
    )
    notes = [
        f"Build: `{args.folder}` ({build}). Each text cut to its first {args.max_tokens} tokens and scored as the "
        "server decodes it: one token per call, every earlier token's keys and values read back from the paged cache "
        f"(`PagedStepModel.infer`); {compared}. The tuning texts chose the int4 export's 8-bit budget default; the "
        "held-out texts (benchmarks/texts/held_out/) chose nothing. The float16 and bfloat16 caches hold half the "
        "bytes per token. Every table figure is computed from the JSON's raw perplexities and token counts "
        "(`domain_tables` in benchmarks/results/quality.py); the JSON's `agreement` is, per text, the share of "
        f"positions whose most likely next token is the same as under the first build ({reference})."
    ]
    title = "The paged KV cache in float16 against float32" if not args.precisions else "Decoding's compute precision"
    results = {
        "title": f"{title}: perplexity on tuning and held-out texts",
        "command": command_line(),
        "machine": machine(args.threads),
        "notes": notes,
        "tables_from": "int4_domains",
        "raw": raw,
    }
    print(write(results, args.json, args.markdown))


if __name__ == "__main__":
    main()
