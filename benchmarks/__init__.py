"""The benchmarks behind the published figures (docs/results/), each a module run from the repository's root:

    python -m benchmarks.benchmark --help            # vaswani's PyTorch models against transformers'
    python -m benchmarks.benchmark_engines --help    # vaswani's exports against other engines
    python -m benchmarks.results docs/results/benchmark_cpu.json   # render a results page from its JSON

Shared by the scripts: `benchmarks.provenance` (the machine a run used, the command that started it) and
`benchmarks.results` (the results pages: their table makers and the rendering). The folders hold what runs
elsewhere: `engines/`, `serve_engines/` and `vllm/` set up other engines' virtual environments and the workers that
run inside them (started as files, so they import only their own folder), `gqa_decode_step/` one study's step
scripts, `shapes/` the reference models' recipes and `texts/` the perplexity texts.
"""
