"""Rank environments, loopback, ports and the hidden main module."""

from __future__ import annotations

import socket
import sys

import psutil

from nbtools.launch import _env


def test_rank_environment_is_what_torchrun_sets():
    env = _env.rank_environment(
        {"PATH": "/bin", "GLOO_SOCKET_IFNAME": "eth9"},
        rank=1,
        world_size=2,
        run_id="r",
        restart_count=3,
        max_restarts=4,
        master_port=1234,
        interface="lo",
    )
    assert env["RANK"] == env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "1234")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "3"
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["GLOO_SOCKET_IFNAME"] == "eth9"  # the caller's choice wins
    assert env["PATH"] == "/bin"


def test_loopback_interface_holds_127_0_0_1():
    name = _env.loopback_interface()
    addresses = psutil.net_if_addrs().get(name, [])
    assert any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses)


def test_free_port_can_be_bound():
    port = _env.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_main_module_hidden_and_restored():
    main = sys.modules["__main__"]
    had_file, file_value = hasattr(main, "__file__"), getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    with _env.main_module_hidden():
        assert not hasattr(main, "__file__")
        assert main.__spec__ is None
    assert hasattr(main, "__file__") == had_file
    assert getattr(main, "__file__", None) == file_value
    assert main.__spec__ is spec


def _loaded_before_user_code() -> dict:
    import sys as rank_sys

    wanted = ("torch._dynamo", "torch.distributed.checkpoint.state_dict", "s3fs")
    return {name: name in rank_sys.modules for name in wanted}


def test_ranks_start_with_what_optimizers_dcp_and_object_stores_import():
    # A restarted group reaches its first step without importing them again: the
    # forkserver loaded them once (s3fs only where it is installed).
    import importlib.util
    import time

    from nbtools import distributed
    from nbtools.launch._local import _forkserver

    # A call made before the preloads are in starts fresh ranks instead (test_launch_first_call).
    while not _forkserver.ready():
        time.sleep(0.05)
    loaded = distributed(processes=2, output="none")(_loaded_before_user_code).distributed()
    assert loaded[0]["torch._dynamo"] and loaded[1]["torch.distributed.checkpoint.state_dict"]
    assert loaded[0]["s3fs"] == (importlib.util.find_spec("s3fs") is not None)
