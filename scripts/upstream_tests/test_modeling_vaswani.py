"""transformers' own common model tests, run against the vaswani families.

This module is not part of vaswani's suite: `scripts/run_upstream_tests.py` copies it into a checkout of
transformers' `tests/` folder (as `tests/models/vaswani/`), where `ModelTesterMixin`, `GenerationTesterMixin` and
`ConfigTester` live, and runs it there. One test class per family and position type, e.g.
`VaswaniDecoderAlibiModelTest`, each a subclass of transformers' mixins exactly as a model inside transformers
would be, so every upstream test runs unmodified. Every skip but one comes
from transformers' own conditions (no GPU, a backend not installed, a feature the config does not have) and is
recorded with its reason by the runner; the one skipped here, with its reason, is `FLAT_ENCODER_DECODER_ROPE`.
"""

import unittest

from transformers import is_torch_available
from transformers.models.auto import modeling_auto
from transformers.testing_utils import require_torch

from ...generation.test_utils import GenerationTesterMixin
from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask

if is_torch_available():
    import torch

    from vaswani import (
        VaswaniDecoderConfig,
        VaswaniDecoderForSequenceClassification,
        VaswaniDecoderModel,
        VaswaniEncoderConfig,
        VaswaniEncoderForSequenceClassification,
        VaswaniEncoderModel,
        VaswaniForCausalLM,
        VaswaniForConditionalGeneration,
        VaswaniForMaskedLM,
        VaswaniForQuestionAnswering,
        VaswaniForTokenClassification,
        VaswaniSeq2SeqConfig,
        VaswaniSeq2SeqModel,
    )
    from vaswani.modeling.positions import POSITION_TYPES

# Every family supports every registered position type (modeling/positions.py).
POSITIONS = {family: tuple(POSITION_TYPES) for family in ("decoder", "encoder", "seq2seq")}

# transformers' tests decide what a class is (a base model, a causal LM, a classifier: which labels it takes, whether
# it trains) by looking its name up in the Auto mappings' name tables, which list the library's own models. List ours
# there as a model inside transformers would be.
TASK_TABLES = {
    "MODEL_MAPPING_NAMES": {
        "vaswani_decoder": "VaswaniDecoderModel",
        "vaswani_encoder": "VaswaniEncoderModel",
        "vaswani_seq2seq": "VaswaniSeq2SeqModel",
    },
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": {"vaswani_decoder": "VaswaniForCausalLM"},
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES": {"vaswani_encoder": "VaswaniForMaskedLM"},
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES": {"vaswani_seq2seq": "VaswaniForConditionalGeneration"},
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": {
        "vaswani_decoder": "VaswaniDecoderForSequenceClassification",
        "vaswani_encoder": "VaswaniEncoderForSequenceClassification",
    },
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": {"vaswani_encoder": "VaswaniForTokenClassification"},
    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": {"vaswani_encoder": "VaswaniForQuestionAnswering"},
}
for _table, _entries in TASK_TABLES.items():
    for _model_type, _class_name in _entries.items():
        getattr(modeling_auto, _table).setdefault(_model_type, _class_name)


class VaswaniModelTester:
    """Builds tiny configs and inputs of one family and position type, the way transformers' model testers do."""

    def __init__(
        self,
        parent,
        family: str,
        position_embedding_type: str,
        batch_size: int = 13,
        seq_length: int = 7,
        is_training: bool = True,
        vocab_size: int = 99,
        hidden_size: int = 32,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        intermediate_size: int = 37,
        max_position_embeddings: int = 512,
        num_labels: int = 3,
    ):
        self.parent = parent
        self.family = family
        self.position_embedding_type = position_embedding_type
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.encoder_seq_length = seq_length
        self.decoder_seq_length = seq_length
        self.is_training = is_training
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.num_labels = num_labels

    def get_config(self):
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            position_embedding_type=self.position_embedding_type,
            num_labels=self.num_labels,
            pad_token_id=0,
        )
        if self.family == "decoder":
            return VaswaniDecoderConfig(**common, bos_token_id=1, eos_token_id=2)
        if self.family == "encoder":
            return VaswaniEncoderConfig(**common, type_vocab_size=2)
        return VaswaniSeq2SeqConfig(**common, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        # Ids from 3 on: no accidental padding, bos or eos inside the inputs.
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
        inputs = {"input_ids": input_ids, "attention_mask": random_attention_mask([self.batch_size, self.seq_length])}
        if self.family == "encoder":
            inputs["token_type_ids"] = ids_tensor([self.batch_size, self.seq_length], 2)
        if self.family == "seq2seq":
            inputs["decoder_input_ids"] = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
            inputs["decoder_attention_mask"] = torch.ones_like(inputs["decoder_input_ids"])
        return config, inputs


class VaswaniCommonTest(ModelTesterMixin):
    """The part every generated class shares; `family` and `position_embedding_type` are set per class."""

    family: str
    position_embedding_type: str
    model_split_percents = [0.5, 0.7, 0.8]

    def setUp(self):
        self.model_tester = VaswaniModelTester(self, self.family, self.position_embedding_type)
        config_class = self.all_model_classes[0].config_class
        # transformers' testers pass hidden_size=37; our configs refuse a width the head count does not divide, and
        # RoPE needs an even head width: 40 over the default 4 heads.
        self.config_tester = ConfigTester(
            self, config_class=config_class, hidden_size=40, position_embedding_type=self.position_embedding_type
        )

    def test_config(self):
        self.config_tester.run_common_tests()


def family_classes(family: str) -> dict:
    if family == "decoder":
        return dict(
            all_model_classes=(VaswaniDecoderModel, VaswaniForCausalLM, VaswaniDecoderForSequenceClassification),
            pipeline_model_mapping={},
        )
    if family == "encoder":
        return dict(
            all_model_classes=(
                VaswaniEncoderModel,
                VaswaniForMaskedLM,
                VaswaniEncoderForSequenceClassification,
                VaswaniForTokenClassification,
                VaswaniForQuestionAnswering,
            ),
            pipeline_model_mapping={},
        )
    return dict(
        all_model_classes=(VaswaniSeq2SeqModel, VaswaniForConditionalGeneration),
        pipeline_model_mapping={},
        is_encoder_decoder=True,
    )


# The one upstream test that cannot apply to a class, with the reason (our own suite covers the behaviour instead).
FLAT_ENCODER_DECODER_ROPE = (
    "not applicable: transformers hands get_text_config(decoder=True) of a flat encoder-decoder config (BART, T5, ours) "
    "out as a copy, so this test's rope settings never reach the model it builds; vaswani's "
    "test_rope_scaling_in_an_encoder_decoder_config_reaches_both_stacks checks the scaling instead"
)
ROPE_SCALING_TESTS = [
    f"test_model_rope_scaling_from_config_{index}_{kind}" for index, kind in enumerate(("linear", "dynamic", "yarn"))
]


def make_test_class(family: str, position_embedding_type: str) -> type:
    generative = family in ("decoder", "seq2seq")
    bases = (VaswaniCommonTest,) + ((GenerationTesterMixin,) if generative else ()) + (unittest.TestCase,)
    attributes = dict(family=family, position_embedding_type=position_embedding_type, **family_classes(family))
    if family == "seq2seq" and position_embedding_type == "rope":
        for test_name in ROPE_SCALING_TESTS:
            attributes[test_name] = unittest.skip(FLAT_ENCODER_DECODER_ROPE)(lambda self: None)
    name = f"Vaswani{family.capitalize()}{position_embedding_type.title().replace('_', '')}ModelTest"
    return require_torch(type(name, bases, attributes))


if is_torch_available():
    # Module-level names only for the classes: pytest collects every TestCase it finds in the module's globals.
    globals().update(
        (test_class.__name__, test_class)
        for test_class in (
            make_test_class(family, position) for family, positions in POSITIONS.items() for position in positions
        )
    )
