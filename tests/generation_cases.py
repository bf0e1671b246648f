"""Checks shared by the generation test modules (`test_generation.py`, `test_conformance_generation.py`)."""

from conftest import TOLERANCE


def assert_same_generation(actual, expected, new_tokens: int) -> None:
    """Same tokens, and logits within TOLERANCE at each of the `new_tokens` generated steps (`generate` outputs
    with `output_logits=True`)."""
    assert actual.sequences.tolist() == expected.sequences.tolist()
    assert len(actual.logits) == len(expected.logits) == new_tokens
    for step, (actual_logits, expected_logits) in enumerate(zip(actual.logits, expected.logits)):
        difference = (actual_logits - expected_logits).abs().max().item()
        assert difference <= TOLERANCE, f"step {step}: logits differ by {difference}"
