"""vLLM plugin: serve vaswani folders through vLLM's Transformers modeling backend without remote code.

vLLM loads `vllm.general_plugins` entry points in every process it starts (engine core, workers). With vaswani
installed, this one imports vaswani (so transformers' Auto classes know its configs and models) and maps each
vaswani architecture to the backend class that wraps it. Then

    vllm serve ./my-vaswani-model                                   # no --trust-remote-code needed

builds the base model with `AutoModel.from_config` from the installed package. Without vaswani installed, the same
folder loads as remote code instead: `vllm serve ./my-vaswani-model --model-impl transformers --trust-remote-code`.

Only the decoder and encoder families are mapped: vLLM's Transformers backend does not serve encoder-decoder models.
"""

# Architecture (the `architectures` entry of a saved config.json) -> vLLM's Transformers backend class.
BACKEND_CLASSES = {
    "VaswaniForCausalLM": "TransformersForCausalLM",
    "VaswaniDecoderModel": "TransformersEmbeddingModel",
    "VaswaniEncoderModel": "TransformersEmbeddingModel",
    "VaswaniEncoderForSequenceClassification": "TransformersForSequenceClassification",
    "VaswaniDecoderForSequenceClassification": "TransformersForSequenceClassification",
}


def register() -> None:
    """The entry point vLLM calls: register vaswani with transformers, and its architectures with vLLM."""
    from vllm import ModelRegistry

    import vaswani  # noqa: F401  (registers AutoConfig / AutoModel* for every vaswani model type)

    for architecture, backend_class in BACKEND_CLASSES.items():
        ModelRegistry.register_model(architecture, f"vllm.model_executor.models.transformers:{backend_class}")
