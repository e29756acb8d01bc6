"""The crash-loop policy's arithmetic (backoff doubling, the sliding window, the limit), the event payload parser,
and the supervisord config start_cluster.sh gets."""

from __future__ import annotations

import configparser

import pytest

from async_vapo.config import load_config
from async_vapo.deploy.crashloop import CrashLoopPolicy, parse_payload
from async_vapo.deploy.supervise import socket_path, write_conf


def test_backoff_doubles_within_the_window_up_to_its_bound():
    p = CrashLoopPolicy(max_restarts=5, window_s=100.0, backoff_s=1.0, backoff_max_s=5.0)
    delays = [p.on_crash("learner", t).delay_s for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]  # 1 * 2**(k-1), capped at 5
    assert p.on_crash("replay", 4.0).delay_s == 1.0  # counted per program


def test_the_limit_trips_after_max_restarts_crashes_in_the_window_and_old_crashes_expire():
    p = CrashLoopPolicy(max_restarts=2, window_s=10.0, backoff_s=0.5, backoff_max_s=60.0)
    assert p.on_crash("verifier", 0.0).restart and p.on_crash("verifier", 1.0).restart
    third = p.on_crash("verifier", 2.0)  # 3 crashes within 10 s > 2
    assert not third.restart and third.crashes_in_window == 3 and "crash loop: 3 crashes within 10 s" in third.reason
    # crashes at 0, 1 and 2 leave the window by 12.0 (a crash exactly window_s old is out): restarts again
    again = p.on_crash("verifier", 12.0)
    assert again.restart and again.crashes_in_window == 1 and again.delay_s == 0.5


def test_no_restart_and_zero_restarts_give_up_at_the_first_crash():
    assert not CrashLoopPolicy(5, 60.0, 1.0, 1.0, restart=False).on_crash("x", 0.0).restart
    d = CrashLoopPolicy(0, 60.0, 1.0, 1.0).on_crash("x", 0.0)
    assert not d.restart and "crash_loop_max_restarts = 0" in d.reason


def test_event_payload_header():
    payload = "processname:rollout-0 groupname:services from_state:RUNNING expected:0 pid:4242\n"
    assert parse_payload(payload) == {"processname": "rollout-0", "groupname": "services", "from_state": "RUNNING",
                                      "expected": "0", "pid": "4242"}


def test_supervisor_config(tmp_path):
    cfg = load_config([], ["cluster.deploy.crash_loop_max_restarts=3", "cluster.deploy.restart_backoff_s=2",
                           "cluster.deploy.stop_grace_s=7.5"])
    run = tmp_path / "run %1"  # '%' must survive supervisord's expansion
    conf = write_conf(run, "local", ["replay", "rollout-0"], cfg.cluster.deploy, "/venv/bin/python", tmp_path)
    ini = configparser.RawConfigParser()
    ini.read(conf)
    assert ini["group:services"]["programs"] == "replay,rollout-0"
    prog = ini["program:rollout-0"]
    assert prog["autorestart"] == "false" and prog["stopasgroup"] == prog["killasgroup"] == "true"
    assert prog["stopwaitsecs"] == "8" and prog["startretries"] == "3"
    assert prog["command"] == f"/bin/bash '{run}/supervisor/rollout-0.sh'".replace("%", "%%")
    listener = ini["eventlistener:crashloop"]["command"]
    assert "--max-restarts 3" in listener and "--backoff-s 2" in listener and "--no-restart" not in listener
    assert ini["supervisord"]["pidfile"] == f"{run}/supervisor/local.pid".replace("%", "%%")
    # a continuous rollout service shuts its engine down itself: SIGTERM to it alone, SIGKILL to its group
    conf = write_conf(run, "local", ["replay", "rollout-0"], cfg.cluster.deploy, "/venv/bin/python", tmp_path,
                      rollout_stops_engine=True)
    ini = configparser.RawConfigParser()
    ini.read(conf)
    assert ini["program:rollout-0"]["stopasgroup"] == "false" and ini["program:rollout-0"]["killasgroup"] == "true"
    assert ini["program:replay"]["stopasgroup"] == "true"
    off = load_config([], ["cluster.deploy.restart=false"]).cluster.deploy
    conf = write_conf(run, "local", ["replay"], off, "/venv/bin/python", tmp_path)
    ini = configparser.RawConfigParser()
    ini.read(conf)
    assert "--no-restart" in ini["eventlistener:crashloop"]["command"]
    assert ini["program:replay"]["startretries"] == "0"


def test_long_socket_paths_move_to_tmp(tmp_path):
    assert socket_path(tmp_path, "local") == f"{tmp_path}/local.sock"
    long = tmp_path / ("d" * 120)
    path = socket_path(long, "local")
    assert path.startswith("/tmp/async-vapo-supervisor-") and len(path) < 100
    assert path == socket_path(long, "local") != socket_path(long, "other")


def test_deploy_knobs_are_validated():
    with pytest.raises(ValueError, match="restart_backoff_max_s"):
        load_config([], ["cluster.deploy.restart_backoff_s=10", "cluster.deploy.restart_backoff_max_s=5"])
    with pytest.raises(ValueError):
        load_config([], ["cluster.deploy.crash_loop_max_restarts=-1"])
