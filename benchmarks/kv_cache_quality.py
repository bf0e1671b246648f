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
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from vaswani.evaluation.perplexity import text_ids
    from vaswani.runtime import OrtModelForCausalLM, default_session_options

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    model = OrtModelForCausalLM.from_pretrained(
        args.folder, engine="openvino", session_options=default_session_options(args.threads)
    )
    sets = {TUNING: tuning_texts(), HELD_OUT: held_out_texts()}
    texts = {name: cut(text) for chosen in sets.values() for name, text in chosen.items()}
    build = describe_build(args.folder)
    raw = {
        "model": "SmolLM2-135M-Instruct, exported by vaswani export (the manifest says how)",
        "texts": {name: {"set": chosen, "characters": len(texts[name])} for chosen in sets for name in sets[chosen]},
        "builds": {
            f"{dtype} cache": {
                "folder": args.folder,
                "engine": "openvino",
                "kv_cache_dtype": dtype,
                "weight_bytes": decoder_weight_bytes(args.folder),
                "build": f"{build}, run by --engine openvino's paged batch, kv_cache_dtype={dtype}",
            }
            for dtype in DTYPES
        },
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "runs": {},
        "agreement": {},
    }
    predictions = {}
    for dtype in DTYPES:
        step_model = model.decoder_runtime.step_model(kv_cache_dtype=dtype)
        for name, text in texts.items():
            ids = text_ids(tokenizer, text, args.max_tokens)
            total, predictions[dtype, name] = decoded_scores(step_model, ids)
            scored = len(ids) - 1
            raw["runs"].setdefault(f"{dtype} cache", {})[name] = {
                "perplexity": math.exp(total / scored), "mean_nll": total / scored, "tokens": scored,
            }  # fmt: skip
            print(f"{dtype} {name}: perplexity {math.exp(total / scored):.3f} over {scored} tokens", flush=True)
        del step_model
    for name in texts:  # the share of positions whose most likely next token is the same under both caches
        raw["agreement"][name] = float((predictions[DTYPES[0], name] == predictions[DTYPES[1], name]).mean())
    notes = [
        f"Build: `{args.folder}` ({build}). Each text cut to its first {args.max_tokens} tokens and scored as the "
        "server decodes it: one token per call, every earlier token's keys and values read back from the paged cache "
        "(`PagedStepModel.infer`); the compute precision is the engine's default for the export, the same for both "
        "caches. The tuning texts chose the int4 export's 8-bit budget default; the held-out texts "
        "(benchmarks/texts/held_out/) chose nothing. The float16 cache holds half the bytes per token. Every table "
        "figure is computed from the JSON's raw perplexities and token counts (`domain_tables` in "
        "benchmarks/results/quality.py); the JSON's `agreement` is, per text, the share of positions whose most likely "
        "next token is the same under both caches."
    ]
    results = {
        "title": "The paged KV cache in float16 against float32: perplexity on tuning and held-out texts",
        "command": command_line(),
        "machine": machine(args.threads),
        "notes": notes,
        "tables_from": "int4_domains",
        "raw": raw,
    }
    print(write(results, args.json, args.markdown))


if __name__ == "__main__":
    main()
