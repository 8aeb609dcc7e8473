"""--replica-roles: one role per data-parallel replica, checked before anything starts."""
import subprocess
import sys

import pytest

from nanovllm_tp.serving.replica_roles import replica_roles


def test_roles_are_read_one_per_replica():
    assert replica_roles(None, 3) == ["mixed"] * 3
    assert replica_roles("prefill,decode", 2) == ["prefill", "decode"]
    assert replica_roles(" prefill , mixed,decode", 3) == ["prefill", "mixed", "decode"]


@pytest.mark.parametrize("text, size, why", [
    ("prefill,decode", 1, "needs --data-parallel-size 2 or more"),
    ("prefill,decode", 3, "lists 2 for --data-parallel-size 3"),
    ("prefill,decoder", 2, "'decoder' is not a role"),
    ("prefill,prefill", 2, "no replica decodes"),
    ("decode,decode", 2, "no replica prefills"),
    ("", 2, "lists 1 for"),
])
def test_a_bad_list_is_refused_by_name(text, size, why):
    with pytest.raises(ValueError, match=why):
        replica_roles(text, size)


def test_serve_refuses_it_in_one_line_before_loading_anything():
    done = subprocess.run([sys.executable, "-m", "nanovllm_tp.launch.serve", "--model", "/nonexistent", "-dp", "2",
                           "--replica-roles", "decode,decode"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("serve: --replica-roles: no replica prefills (give one prefill "
                                                    "or mixed)")
