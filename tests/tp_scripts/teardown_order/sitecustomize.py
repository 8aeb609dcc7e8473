"""Loaded at start-up by worker processes of the teardown test (via PYTHONPATH): records, in the file named by
NVTP_TEST_TEARDOWN_LOG, when the runner is released and when the process group is destroyed, and how many
ModelRunners still hold a KV cache at that moment. The test installs the same recorder on rank 0."""
import gc
import json
import os


def live_kv_runners() -> int:
    from nanovllm_tp.workers.model_runner import ModelRunner
    return sum(1 for o in gc.get_objects() if type(o) is ModelRunner and getattr(o, "k_cache", None) is not None)


def install(log_path: str, setattr=setattr) -> None:
    import torch.distributed as dist
    from nanovllm_tp.workers import model_runner

    release, destroy = model_runner.ModelRunner.release, dist.destroy_process_group

    def record(event: str) -> None:
        with open(log_path, "a") as f:
            f.write(json.dumps({"rank": os.environ.get("RANK", "0"), "event": event,
                                "live_kv_runners": live_kv_runners()}) + "\n")

    def recording_release(self, *args, **kwargs):
        release(self, *args, **kwargs)
        record("release")

    def recording_destroy(*args, **kwargs):
        record("destroy")
        return destroy(*args, **kwargs)

    setattr(model_runner.ModelRunner, "release", recording_release)
    setattr(dist, "destroy_process_group", recording_destroy)


if os.environ.get("NVTP_TEST_TEARDOWN_LOG") and os.environ.get("RANK") not in (None, "0"):
    install(os.environ["NVTP_TEST_TEARDOWN_LOG"])
