"""vLLM plugin: serve vaswani folders through vLLM's Transformers modeling backend without remote code.

vLLM loads `vllm.general_plugins` entry points in every process it starts (engine core, workers). With vaswani
installed, this one imports vaswani (so transformers' Auto classes know its configs and models) and maps each
vaswani architecture to the backend class that wraps it. Then

    vllm serve ./my-vaswani-model                                   # no --trust-remote-code needed

builds the base model with `AutoModel.from_config` from the installed package. Without vaswani installed, the same
folder loads as remote code instead: `vllm serve ./my-vaswani-model --model-impl transformers --trust-remote-code`.

Classifiers load only this way: as remote code, vLLM's stock classifier finds no place for vaswani's `score` head.
Only the decoder and encoder families are mapped: vLLM's Transformers backend does not serve encoder-decoder models.
"""

BACKEND = "vllm.model_executor.models.transformers"
# Architecture (the `architectures` entry of a saved config.json) -> the vLLM class that serves it.
BACKEND_CLASSES = {
    "VaswaniForCausalLM": f"{BACKEND}:TransformersForCausalLM",
    "VaswaniDecoderModel": f"{BACKEND}:TransformersEmbeddingModel",
    "VaswaniEncoderModel": f"{BACKEND}:TransformersEmbeddingModel",
    # The stock classifier cannot load vaswani's `score` head (see vaswani/vllm_models.py).
    "VaswaniEncoderForSequenceClassification": "vaswani.vllm_models:VaswaniTransformersForSequenceClassification",
    "VaswaniDecoderForSequenceClassification": "vaswani.vllm_models:VaswaniTransformersForSequenceClassification",
}


def register() -> None:
    """The entry point vLLM calls: register vaswani with transformers, and its architectures with vLLM."""
    from vllm import ModelRegistry

    import vaswani  # noqa: F401  (registers AutoConfig / AutoModel* for every vaswani model type)

    for architecture, backend_class in BACKEND_CLASSES.items():
        ModelRegistry.register_model(architecture, backend_class)
