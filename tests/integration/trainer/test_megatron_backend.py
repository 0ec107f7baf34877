"""`trainer.backend=megatron`: megatron-core's `GPTModel` built from Hugging Face Llama and Qwen2
folders by our own mapping (`trainer/megatron/convert.py`), on the CPU, fp32.

The contract every backend keeps (alignment, micro-batching, checkpoints, exported weights) is in
`test_trainer_backends.py`; here: the mapping is exact both ways and the logits are Hugging
Face's, a step moves the weights as the torch backend's does, two tensor-parallel ranks and two
pipeline stages score and train as one, the CPU engine serves the exported weights with the
trainer's own greedy tokens, and what megatron cannot do here is refused by name.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from omniloop.errors import ConfigError
from omniloop.inference.core import EngineCore
from omniloop.inference.generation import GenerationRequest
from omniloop.inference.models import resolve_model
from omniloop.trainer.batch import TrainBatch
from omniloop.trainer.config import TrainerConfig
from omniloop.trainer.megatron.convert import gpt_shape, to_hf, to_megatron
from omniloop.trainer.megatron.model import MegatronPolicy
from omniloop.trainer.packing import pack_rows
from omniloop.trainer.torch_backend import TorchTrainerBackend

EXACT = 1e-5
# Weights after AdamW steps at lr 1e-3: each step moves a weight by about lr * sign(gradient),
# so a gradient near zero, summed in another order, can move its weight differently by a
# fraction of lr. A wrong gradient moves many weights by a whole lr.
STEPPED = 5e-5
"""fp32 tolerance for the same quantity computed by the two implementations."""


@pytest.fixture(scope="module")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2: q/k/v biases, grouped-query attention, separate output weights."""
    config = Qwen2Config(
        vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random biases, so that a wrong bias layout shows
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("qwen2") / "model"
    model.save_pretrained(folder)
    return folder


def trainer(model: str | Path, backend: str, **config: object) -> TorchTrainerBackend:
    settings = {"device": "cpu", "backend": backend, "lr": 1e-3, **config}
    return TorchTrainerBackend(model, TrainerConfig.model_validate(settings))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_are_hugging_faces_and_the_mapping_is_exact_both_ways(
    family: str, qwen2_model: Path
) -> None:
    folder = resolve_model("tiny") if family == "llama" else qwen2_model
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    policy = MegatronPolicy.load(folder)
    ids = torch.randint(
        0, hf.config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        ours = policy.module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        theirs = hf(input_ids=ids).logits
    assert (ours - theirs).abs().max() < EXACT

    state = {n: p.detach() for n, p in hf.named_parameters()}
    shape = gpt_shape(hf.config)
    back = dict(to_hf(to_megatron(state, shape), shape))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[name], state[name]) for name in state)
    assert dict(policy.hf_weights()).keys() == state.keys()


def assert_same_steps(
    a: TorchTrainerBackend, b: TorchTrainerBackend, batch: TrainBatch, grad_norm_rel: float
) -> None:
    """`a` and `b` score `batch` alike, take two steps on it alike and end with the same
    weights (within `STEPPED`) and logprobs."""
    assert (a.logprobs(batch) - b.logprobs(batch)).abs().max() < EXACT
    for _ in range(2):
        ours, theirs = a.train_step(batch), b.train_step(batch)
        assert ours["actor/grad_norm"] == pytest.approx(
            theirs["actor/grad_norm"], rel=grad_norm_rel
        )
        assert ours["actor/loss"] == pytest.approx(theirs["actor/loss"], abs=1e-6)
    after = dict(a.named_weights())
    for name, weight in b.named_weights():
        torch.testing.assert_close(after[name], weight, atol=STEPPED, rtol=0, msg=name)
    assert (a.logprobs(batch) - b.logprobs(batch)).abs().max() < EXACT


def test_a_step_moves_the_weights_as_the_torch_backends_step(make_batch) -> None:
    batch = make_batch([11, 17, 6, 14], advantages=[1.0, -0.5, 0.7, -1.2], seed=21)
    # megatron's norm sums in float64, torch's in float32.
    assert_same_steps(trainer("tiny", "megatron"), trainer("tiny", "torch"), batch, 1e-4)


def test_packed_rows_score_and_train_as_padded_rows(make_batch) -> None:
    """Rows of very different lengths, packed into fewer rows (`pack_sequences`, the
    default): the logprobs and the steps of the padded batch."""
    batch = make_batch([17, 5, 9, 3, 12, 4], advantages=[1.0, -0.4, 0.8, -1.0, 0.3, 0.6], seed=5)
    first = batch.split(4)[0]
    assert pack_rows(first.input_ids, first.attention_mask).input_ids.shape[0] == 2
    packed = trainer("tiny", "megatron", micro_batch_size=4)
    padded = trainer("tiny", "megatron", micro_batch_size=4, pack_sequences=False)
    assert_same_steps(packed, padded, batch, 1e-5)


def test_the_engine_serves_the_exported_weights_with_the_trainers_greedy_tokens(
    tmp_path: Path, make_batch
) -> None:
    megatron = trainer("tiny", "megatron", lr=1e-2)
    for _ in range(3):
        megatron.train_step(make_batch([12, 9], advantages=[1.0, -1.0], seed=23))
    megatron.save_hf(tmp_path / "hf")

    prompt = [1, 42, 7, 1999, 314, 15]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            tokens = torch.tensor([ids])
            logits = megatron.model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
            ids.append(int(logits[0, -1].argmax()))
    engine = EngineCore(tmp_path / "hf", max_batch=2, max_context=64, threads=1)
    engine.start()
    try:
        request = GenerationRequest(input_ids=prompt, max_new_tokens=8, temperature=0.0)
        result = engine.submit(request).result(timeout=120)
    finally:
        engine.shutdown()
    assert result.output_ids == ids[len(prompt) :]


def test_what_megatron_cannot_do_here_is_refused_by_name(make_batch) -> None:
    with pytest.raises(ConfigError, match="qwen2_5_omni_thinker"):
        trainer("tiny-omni", "megatron")
    with pytest.raises(pydantic.ValidationError, match="fp32"):
        TrainerConfig(backend="megatron", dtype="bf16")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="gradient_checkpointing"):
            trainer("tiny", "megatron", gradient_checkpointing=True)
    batch = make_batch([8])
    with_media = batch.replace(media_inputs=({"pixel_values": torch.zeros(4, 8)},))
    with pytest.raises(ValueError, match="media"):
        trainer("tiny", "megatron").logprobs(with_media)


@pytest.fixture
def one_rank(tmp_path: Path, make_batch, rank_script) -> tuple[Path, dict]:
    """What one rank sees of a batch (saved in the folder returned), and its checkpoint. Two
    of the rows open with the same 18 tokens, which the packed micro-batch holds once (the
    third row is ordered last, so that the two share a micro-batch of 2). Most tokens are
    trained: with few, many weights get gradients near zero, whose AdamW steps (about ±lr
    whatever their size) the ranks' summation order can flip."""
    batch = make_batch([21, 9, 25], prompt=4, advantages=[1.0, -0.7, 0.4], seed=31)
    ids = batch.input_ids.clone()
    ids[2, :18] = ids[0, :18]
    ids[1, 0] = 1999
    assert ids[0, 0] < 1999
    batch = batch.replace(input_ids=ids)
    torch.save(batch, tmp_path / "batch.pt")
    _, ranks = rank_script("model_parallel_ranks")
    return tmp_path, ranks.run(1, 1, batch, tmp_path)


@pytest.mark.parametrize(
    ("tensor_parallel", "stages"),
    [(2, 1), (1, 2), (2, 2)],
    ids=["tensor-parallel", "pipeline", "tensor-parallel-pipeline"],
)
def test_model_parallel_ranks_score_and_train_as_one_rank(
    tensor_parallel: int, stages: int, one_rank: tuple[Path, dict], rank_script, tmp_path: Path
) -> None:
    """Processes over gloo, each holding half of every split weight (tensor parallel), one of
    the two layers (pipeline stages), or a half of one layer (both), against one; each resumes
    the other's checkpoint (checkpoints hold the whole weights and optimizer state)."""
    folder, one = one_rank
    script, _ = rank_script("model_parallel_ranks")
    out = tmp_path / "rank0.pt"
    world = tensor_parallel * stages
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                str(world),
                str(tmp_path / "store"),
                str(folder / "batch.pt"),
                str(out),
                str(folder),
                str(stages),
            ]
        )
        for r in range(world)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * world
    two = torch.load(out, weights_only=False)  # what the ranks saw

    for key in ("before", "after"):
        assert (two[key] - one[key]).abs().max() < EXACT, key
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert two["weights"].keys() == one["weights"].keys()
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, atol=STEPPED, rtol=0, msg=name)
        assert torch.equal(two["loaded"][name], weight), name  # two ranks resumed one's

    # One rank resumes two's: their weights exactly, their optimizer state, their version.
    resumed = trainer("tiny", "megatron")
    assert resumed.load(folder / f"tp{tensor_parallel}pp{stages}") == {"step": 2}
    assert resumed.version == 2
    for name, weight in resumed.named_weights():
        assert torch.equal(weight, two["weights"][name]), name
    saved = torch.load(folder / "tp1pp1" / "optimizer.pt", weights_only=True)["optimizer"]
    for index, state in resumed.optimizer.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            expected = saved["state"][index][key]
            assert state[key].shape == expected.shape
            torch.testing.assert_close(state[key], expected, atol=1e-6, rtol=1e-3)


def test_model_parallel_ranks_need_a_process_each() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel=2"):
        trainer("tiny", "megatron", megatron={"tensor_parallel": 2})
    with pytest.raises(ConfigError, match="pipeline_parallel=2"):
        trainer("tiny", "megatron", megatron={"pipeline_parallel": 2})
