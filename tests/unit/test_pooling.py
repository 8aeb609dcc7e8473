"""Embedding pieces without a model: the pooling a model directory declares, the embedding made from pooled sums,
and the scheduler's prefill-only rows (their plan flag, pool chunks, no sampling entry, blocks freed)."""
import json

import numpy as np
import pytest

from nanovllm_tp.pooling.params import CLS, LAST, MEAN, ModelPooling, Pooling, PoolingParams, check_pooler_config
from nanovllm_tp.scheduler import PREFILL, Scheduler, SchedulerConfig, Sequence, StepPlan
from nanovllm_tp.scheduler.plan import PlanError
from nanovllm_tp.workers.plan_check import PlanLimits, check_plan
from tests.embedding_helpers import model_copy


@pytest.fixture
def plain_dir(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
    return str(d)


@pytest.mark.parametrize("mode, normalize, kind", [("pooling_mode_mean_tokens", True, MEAN),
                                                   ("pooling_mode_cls_token", False, CLS),
                                                   ("pooling_mode_lasttoken", True, LAST)])
def test_sentence_transformers_pooling_is_read(plain_dir, tmp_path, mode, normalize, kind):
    got = ModelPooling.read(model_copy(plain_dir, str(tmp_path / "m"), mode, normalize))
    assert (got.kind, got.normalize, got.refused) == (kind, normalize, None)


def test_default_and_refusals(plain_dir, tmp_path):
    assert ModelPooling.read(plain_dir) == ModelPooling(LAST, True)        # a decoder embedding model
    assert ModelPooling.read(str(tmp_path / "model.gguf")) == ModelPooling(LAST, True)
    d = model_copy(plain_dir, str(tmp_path / "max"), "pooling_mode_max_tokens")
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        ModelPooling.read(d).resolve(PoolingParams(), 8)
    d = model_copy(plain_dir, str(tmp_path / "dense"), "pooling_mode_mean_tokens")
    modules = json.loads((tmp_path / "dense" / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "dense" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="'Dense' is not implemented"):
        ModelPooling.read(d).resolve(PoolingParams(), 8)


def test_pooler_config_overrides_the_files(plain_dir, tmp_path):
    d = model_copy(plain_dir, str(tmp_path / "max"), "pooling_mode_max_tokens", normalize=False)
    chosen = ModelPooling.read(d, {"pooling_type": MEAN, "normalize": True})
    assert chosen.resolve(PoolingParams(), 8) == Pooling(MEAN, True)        # the refused mode replaced
    assert ModelPooling.read(plain_dir, {"normalize": False}).resolve(PoolingParams(), 8) == Pooling(LAST, False)
    for bad, error in [({"pooling_type": "MAX"}, ValueError), ({"softmax": True}, ValueError),
                       ({"normalize": 1}, TypeError), ([LAST], TypeError)]:
        with pytest.raises(error, match="pooler_config"):
            check_pooler_config(bad)


def test_matryoshka_dimensions(plain_dir, tmp_path):
    listed = ModelPooling.read(model_copy(plain_dir, str(tmp_path / "a"),
                                          config_extra={"matryoshka_dimensions": [4, 8]}))
    assert listed.resolve(PoolingParams(dimensions=4), 8) == Pooling(LAST, True, 4)
    with pytest.raises(ValueError, match=r"one of this model's \[4, 8\]"):
        listed.resolve(PoolingParams(dimensions=3), 8)
    flagged = ModelPooling.read(model_copy(plain_dir, str(tmp_path / "b"), config_extra={"is_matryoshka": True}))
    with pytest.raises(ValueError, match="hidden size"):
        flagged.resolve(PoolingParams(dimensions=9), 8)
    assert flagged.resolve(PoolingParams(dimensions=3, normalize=False), 8) == Pooling(LAST, False, 3)


def test_finish_means_truncates_then_normalizes():
    total = np.array([3.0, 4.0, 12.0], np.float32)
    np.testing.assert_allclose(Pooling(MEAN, False).finish(total, 2), [1.5, 2.0, 6.0])
    np.testing.assert_allclose(Pooling(LAST, True, 2).finish(total, 2), [0.6, 0.8])
    np.testing.assert_allclose(Pooling(CLS, True).finish(np.zeros(3), 5), [0, 0, 0])     # no division by zero


def test_scheduler_runs_embedding_rows_prefill_only():
    """Chunks of 8 tokens: a mean-pooled prompt sums every chunk, a last-token one only its final token; neither
    samples; both finish with their prompt, their blocks free; a generation row beside them keeps its logits row."""
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=16, kvcache_block_size=4, max_model_len=32,
                                      max_num_batched_tokens=8))
    mean = Sequence(0, list(range(10)), pooling=Pooling(MEAN, False))
    last = Sequence(1, list(range(3)), pooling=Pooling(LAST, False))
    gen = Sequence(2, [1, 2], max_tokens=1)
    for s in (mean, last, gen):
        sched.add(s)
    steps = []
    while sched.has_unfinished():
        step = sched.schedule()
        steps.append(step)
        plan = StepPlan.decode(step.plan.encode())
        assert plan.kind == PREFILL and plan.hidden_rows is not None
        assert all(e is gen for e in step.sampling.seqs)
        pooled = [np.full(4, len(c.token_rows), np.float32) for c in step.pool_chunks]
        sched.postprocess([7] * len(step.sampling.seqs), pooled=pooled)
    assert [[(c.seq.seq_id, len(c.token_rows), c.final) for c in s.pool_chunks] for s in steps] == \
        [[(0, 8, False)], [(0, 2, True), (1, 1, True)]]
    assert steps[1].plan.hidden_rows.tolist() == [True, True, False]
    assert steps[1].sampling.logits_index.tolist() == [0]      # gen's logits: the only row the LM head computes
    np.testing.assert_allclose(mean.embedding, np.full(4, 1.0))     # (8 + 2) / 10 tokens
    np.testing.assert_allclose(last.embedding, np.full(4, 1.0))
    assert mean.is_finished and last.is_finished and gen.token_ids[-1] == 7
    assert sched.block_manager.num_free_blocks == 16


def test_plan_check_refuses_a_bad_hidden_rows():
    sched = Scheduler(SchedulerConfig(num_kvcache_blocks=8, kvcache_block_size=4, max_model_len=32))
    sched.add(Sequence(0, [1, 2, 3], pooling=Pooling(LAST, True)))
    plan = StepPlan.decode(sched.schedule().plan.encode())
    limits = PlanLimits(num_blocks=8, block_size=4, max_model_len=32, vocab_size=100)
    check_plan(plan, limits)
    plan.hidden_rows = np.ones(2, bool)
    with pytest.raises(PlanError, match="hidden_rows: 2 entries for 1 rows"):
        check_plan(plan, limits)
    raw = plan.encode().replace(b"|b1", b"<i8")
    with pytest.raises(PlanError, match="hidden_rows"):
        StepPlan.decode(raw)
