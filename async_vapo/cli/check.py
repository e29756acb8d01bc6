"""``async-vapo check``: what a run needs, checked before anything starts; one line per problem, exit 1 on any.

* data (``task.kind = "files"``): every record of every file read with the configured keys
  (:func:`async_vapo.tasks.files.check_problems`: the loader's own messages, each naming its file and line);
* the answer format: a response that states a reference answer the way ``verifier.answer_format`` reads it
  (``\\boxed{A}``, ``Answer: A``) is graded correct, for the first few answers of the training file; or
  ``verifier.reward_fn`` imports;
* the model: ``model.path`` (and ``model.critic_path``) a directory with a config, weights files and (the policy) a
  tokenizer that load, without loading the weights; the chat template when ``task.prompt_format = "chat"``; the
  longest prompt + ``rollout.max_response_tokens`` within the model's positions;
* ports (the cluster, not ``train``): every port of the services this host runs can be bound, and no two services
  share one;
* disk: the free space where the run directory goes holds the run's checkpoints (parameters x 12 B of float32
  masters and AdamW moments per model, + 4 B per parameter per model for the HF copies of an unsharded learner,
  times the checkpoints ``train.total_steps`` / ``train.checkpoint_every`` makes: none is deleted).

``async-vapo train`` and ``deploy/start_cluster.sh`` run the same check first (``--no-check`` skips it).
"""

from __future__ import annotations

import argparse
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from async_vapo.cli._common import add_config_args, load

ANSWERS_TRIED = 5
"""Reference answers of the training file the answer-format check grades."""
SHOWN_PER_FILE = 20
"""Problems printed per data file by default (--all-problems prints every one); the rest are counted."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="check a run before starting it: data files, answer format, model and "
                                     "tokenizer, ports, disk space (exit 1 on a problem; nothing is started)")
    add_config_args(p)
    p.add_argument("--for", dest="app", choices=("cluster", "train"), default="cluster",
                   help="what will run: 'cluster' (deploy/start_cluster.sh, the default) checks the ports of the "
                        "services this host runs; 'train' (the one-process trainer) binds none")
    p.add_argument("--hostfile", help="start_cluster.sh's hostfile: only the services on this host are checked for "
                                      "ports")
    p.add_argument("--local-name", action="append", default=[],
                   help="another name of this machine in the hostfile (localhost, 127.0.0.1 and its host names are)")
    p.add_argument("--run-dir", help="where the run will write (default: the config's train.output_dir)")
    p.add_argument("--all-problems", action="store_true",
                   help=f"print every problem of a data file (default: the first {SHOWN_PER_FILE}, the rest counted)")
    p.set_defaults(run=run)
    return p


@dataclass
class Report:
    """What the check found: ``ok`` lines (what was checked) and ``problems`` (one line each)."""
    ok: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def text(self) -> str:
        lines = [f"ok  {line}" for line in self.ok] + self.problems
        tail = (f"{len(self.problems)} problem(s) found; nothing was started" if self.problems
                else "no problem found")
        return "\n".join([*lines, tail])


def run(args: argparse.Namespace) -> int:
    cfg = load(args)
    report = check(cfg, app=args.app, hostfile=args.hostfile, local_names=args.local_name, run_dir=args.run_dir,
                   shown_per_file=None if args.all_problems else SHOWN_PER_FILE)
    print(report.text())
    return 1 if report.problems else 0


def check(cfg, *, app: str = "cluster", hostfile: str | None = None, local_names: Sequence[str] = (),
          run_dir: str | None = None, shown_per_file: int | None = SHOWN_PER_FILE) -> Report:
    """Every check of the module docstring on ``cfg``."""
    r = Report()
    problems = _data(cfg, r, shown_per_file)
    _answer_format(cfg, problems, r)
    params = _model(cfg, problems, r)
    if app == "cluster":
        _ports(cfg, r, hostfile, local_names)
    _disk(cfg, r, params, Path(run_dir) if run_dir else cfg.run_dir())
    return r


# ---------------------------------------------------------------- data and answers

def _data(cfg, r: Report, shown_per_file: int | None) -> list:
    """Every record of the task's files; the training file's problems (for the answer and prompt checks)."""
    from async_vapo.tasks.files import check_problems

    t = cfg.task
    if t.kind != "files":
        r.ok.append(f"data: task.kind = {t.kind!r} (generated problems, no file)")
        return []
    train: list = []
    for path in dict.fromkeys((t.train_path, t.eval_path)):
        problems, errors = check_problems(path, prompt_key=t.prompt_key, answer_key=t.answer_key,
                                          messages_key=t.messages_key,
                                          extra_keys=t.extra_keys if cfg.verifier.reward_fn else ())
        train = train or problems
        keys = ", ".join(f"task.{k} = {getattr(t, k)!r}" for k in ("prompt_key", "answer_key", "messages_key")
                         if getattr(t, k) is not None) or "keys detected from the first record"
        if not errors:
            r.ok.append(f"data: {path}: {len(problems)} records read ({keys})")
            continue
        shown = errors if shown_per_file is None else errors[:shown_per_file]
        r.problems += shown
        if len(errors) > len(shown):
            r.problems.append(f"{path}: ... and {len(errors) - len(shown)} more bad records "
                              f"({len(errors)} of {len(errors) + len(problems)}; --all-problems lists them)")
    return train


def reference_response(answer: str, answer_format: str) -> str:
    """A response stating ``answer`` the way ``answer_format`` reads it."""
    return {"answer_line": f"Answer: {answer}", "solution": answer}.get(answer_format, f"\\boxed{{{answer}}}")


def _answer_format(cfg, problems: list, r: Report) -> None:
    v = cfg.verifier
    if v.reward_fn:
        from async_vapo.verify.reward_fn import RewardFnError, load_reward_fn, reward_call

        try:
            form = reward_call(load_reward_fn(v.reward_fn), v.reward_fn).form
            r.ok.append(f"answers: verifier.reward_fn = {v.reward_fn!r} imports, called in its {form!r} form (it "
                        "grades, not answer_format)")
        except RewardFnError as e:
            r.problems.append(str(e))
        return
    if not problems:
        return
    from async_vapo.verify.check import check_answer

    tried = list({p.answer: p for p in problems}.values())[:ANSWERS_TRIED]
    bad = 0
    for p in tried:
        response = reference_response(p.answer, v.answer_format)
        correct, reason = check_answer(response, p.answer, answer_format=v.answer_format, timeout_s=5)
        if not correct:
            bad += 1
            r.problems.append(f"{p.meta['path']}:{p.meta['row']}: verifier.answer_format = {v.answer_format!r} "
                              f"does not grade its own reference answer {p.answer!r} as correct (the response "
                              f"{response!r} is {reason!r}); use another answer_format or a verifier.reward_fn")
    if not bad:
        r.ok.append(f"answers: verifier.answer_format = {v.answer_format!r} grades {len(tried)} reference "
                    f"answer(s) stated as {reference_response('A', v.answer_format)!r} correct")


# ---------------------------------------------------------------- model

def _model(cfg, problems: list, r: Report) -> int | None:
    """The model's checks; its parameter count (None: unknown)."""
    m = cfg.model
    if m.path is None:
        from async_vapo.deploy.scale import ModelShape

        b = cfg.base_model
        r.ok.append("model: the embedded tiny model (built or reused at the start)")
        return ModelShape(128, b.hidden_size, b.intermediate_size, b.num_layers, b.num_heads, b.num_kv_heads,
                          b.hidden_size // b.num_heads, qkv_bias=True).params()  # 128: the character vocabulary
    params = _model_dir(m.path, "model.path", r)
    if m.critic_path is not None:
        _model_dir(m.critic_path, "model.critic_path", r)
    if params is not None:
        _tokenizer(cfg, problems, r)
    return params


def _model_dir(path: str, key: str, r: Report) -> int | None:
    """A directory with config.json and weights files whose config loads (transformers' AutoConfig); its
    parameters from the config's shape, else from the weights' size."""
    d = Path(path).expanduser()
    if not d.is_dir():
        r.problems.append(f"{key} = {path!r}: {'not a directory' if d.exists() else 'no such directory'}")
        return None
    weights = sorted(d.glob("*.safetensors")) or sorted(d.glob("pytorch_model*.bin"))
    if not weights:
        r.problems.append(f"{key} = {path!r}: no weights (*.safetensors or pytorch_model*.bin) in the directory")
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001  (whatever transformers raises on a bad config is reported as is)
        r.problems.append(f"{key} = {path!r}: its config does not load ({type(e).__name__}: {str(e)[:300]})")
        return None
    params = _params(d, hf.to_dict(), weights)
    r.ok.append(f"model: {key} = {path!r}: {hf.model_type} config loads"
                + (f", {params / 1e9:.2f} B parameters" if params else "") + f", {len(weights)} weights file(s)")
    return params


def _params(d: Path, hf: dict, weights: list[Path]) -> int | None:
    from async_vapo.deploy.scale import DTYPE_BYTES, ModelShape

    try:
        return ModelShape.from_hf_config(hf).params()
    except (KeyError, TypeError, ZeroDivisionError):
        pass
    size = sum(w.stat().st_size for w in weights)
    return size // DTYPE_BYTES.get(str(hf.get("torch_dtype")), 4) if size else None


def _tokenizer(cfg, problems: list, r: Report) -> None:
    """The tokenizer loads, renders the prompts as the run will (the chat template when asked for), and the longest
    prompt leaves room for a whole response within the model's positions."""
    t, path = cfg.task, cfg.model.path
    try:
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(Path(path).expanduser()))
        positions = getattr(AutoConfig.from_pretrained(str(Path(path).expanduser())), "max_position_embeddings", None)
    except Exception as e:  # noqa: BLE001
        r.problems.append(f"model.path = {path!r}: its tokenizer does not load ({type(e).__name__}: {str(e)[:300]})")
        return
    from async_vapo.rollout.generate import PromptEncoder

    try:
        encoder = PromptEncoder.from_config(cfg, tok)
    except ValueError as e:  # the chat template asked for and missing
        r.problems.append(f"model.path = {path!r}: {e}")
        return
    what = "its chat template" if t.prompt_format == "chat" else "task.prompt_template"
    if not problems:
        r.ok.append(f"tokenizer: loads ({type(tok).__name__}); prompts rendered with {what}")
        return
    longest = max(problems, key=lambda p: len(encoder(p)))
    n = len(encoder(longest))
    r.ok.append(f"tokenizer: loads; {len(problems)} prompts rendered with {what}, the longest {n} tokens "
                f"({longest.meta['path']}:{longest.meta['row']})")
    if positions and n + cfg.rollout.max_response_tokens + 1 > positions:
        r.problems.append(f"{longest.meta['path']}:{longest.meta['row']}: a prompt of {n} tokens + "
                          f"rollout.max_response_tokens ({cfg.rollout.max_response_tokens}) + 1 exceeds the model's "
                          f"{positions} positions (max_position_embeddings): the engine refuses it")


# ---------------------------------------------------------------- ports and disk

PORT_KEYS = {"replay": ("replay_port", "replay_batch_port", "replay_metrics_port"),
             "verifier": ("verifier_port", "verifier_metrics_port"),
             "learner": ("weights_port", "acks_port", "weights_fetch_port", "learner_metrics_port")}
"""``cluster.ports`` keys each service binds (an engine binds rollout_metrics_port + its index)."""


def service_ports(cfg, placement) -> list[tuple[str, str, int]]:
    """(process, ``cluster.ports`` key, port) for every process of ``placement``; the learner's rendezvous port on
    the first learner host when the learner spans several."""
    p = cfg.cluster.ports
    out = []
    for proc in placement.processes:
        if proc.name.startswith("rollout-"):
            i = int(proc.name.split("-")[1])
            out.append((proc.name, f"rollout_metrics_port + {i}", p.rollout_metrics_port + i))
        elif proc.name == "learner":
            out += [(proc.name, k, getattr(p, k)) for k in PORT_KEYS["learner"]]
            if len(placement.learners) > 1:
                out.append((proc.name, "learner_rdzv_port", p.learner_rdzv_port))
        elif proc.name in PORT_KEYS:
            out += [(proc.name, k, getattr(p, k)) for k in PORT_KEYS[proc.name]]
    return out


def _ports(cfg, r: Report, hostfile: str | None, local_names: Sequence[str]) -> None:
    from async_vapo.deploy.launch import cluster_placement
    from async_vapo.deploy.placement import PlacementError

    try:
        placement, _ = cluster_placement(cfg, hostfile, 0)
    except (PlacementError, OSError) as e:
        r.problems.append(f"placement: {e}")
        return
    local = {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn(),
             *local_names}
    here = [p for p in service_ports(cfg, placement)
            if placement.get(p[0]).host in local or placement.get(p[0]).host.split(".")[0] in local]
    seen: dict[int, str] = {}
    bind = cfg.cluster.hosts.bind_host
    busy = 0
    for name, key, port in here:
        if port in seen:
            r.problems.append(f"port {port}: {name} ({key}) and {seen[port]} both bind it on this host")
            busy += 1
            continue
        seen[port] = f"{name} ({key})"
        error = _bind_error(bind, port)
        if error:
            busy += 1
            r.problems.append(f"port {port} ({name}: cluster.ports.{key.split(' ')[0]}) on {bind}: {error} (another "
                              "cluster still running? deploy/stop_cluster.sh RUN_DIR; or set another port)")
    if not busy:
        names = sorted({n for n, _, _ in here})
        r.ok.append(f"ports: {len(here)} free on {bind} for {', '.join(names) or 'no service'} (this host's "
                    "services)")


def _bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (None: it can). SO_REUSEADDR as the services' sockets (ZeroMQ and
    the HTTP server both set it), so a port in TIME_WAIT is not taken for a busy one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _models_sharded(cfg) -> tuple[int, bool]:
    """Models a checkpoint holds (policy, and a critic), and whether the learner is sharded (no HF copies)."""
    return 2 if cfg.algo.uses_critic else 1, cfg.async_.learner_devices > 1 or cfg.learner.fsdp == "on"


def checkpoint_bytes(cfg, params: int) -> tuple[int, int]:
    """(bytes of one checkpoint, checkpoints the run writes): float32 masters and AdamW's two moments (12 B per
    parameter per model) in ``dcp/``, and an unsharded learner's float32 HF copies (4 B); one every
    ``train.checkpoint_every`` updates and one at the end, none deleted."""
    models, sharded = _models_sharded(cfg)
    every, total = cfg.train.checkpoint_every, cfg.train.total_steps
    count = max(1, total // every + (1 if total % every else 0)) if every else 1
    return models * params * (12 if sharded else 16), count


def checkpoints_disk(cfg, params: int) -> tuple[int, str]:
    """Bytes the run's checkpoints take at its end, and how they add up: :func:`checkpoint_bytes`, with
    ``train.keep_checkpoints`` the newest k whole and the older ones as their HF weights (4 B per parameter per
    model, unsharded and ``train.keep_weights``) or nothing."""
    per, count = checkpoint_bytes(cfg, params)
    keep = cfg.train.keep_checkpoints
    if not keep or keep >= count:
        return count * per, f"{count} checkpoint(s) of {per / 2**30:,.2f} GiB = {count * per / 2**30:,.2f} GiB"
    models, sharded = _models_sharded(cfg)
    weights = models * params * 4 if cfg.train.keep_weights and not sharded else 0
    total = keep * per + (count - keep) * weights
    return total, (f"{keep} resumable checkpoint(s) of {per / 2**30:,.2f} GiB and {count - keep} pruned to "
                   f"{weights / 2**30:,.2f} GiB (train.keep_checkpoints = {keep}) = {total / 2**30:,.2f} GiB")


def _disk(cfg, r: Report, params: int | None, run_dir: Path) -> None:
    if params is None:
        return
    total, need = checkpoints_disk(cfg, params)
    where = run_dir.expanduser().resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if total > free:
        r.problems.append(f"disk: {need} do not fit the {free / 2**30:,.1f} GiB free at {where} (train.output_dir "
                          "on a larger disk, a larger train.checkpoint_every, or train.keep_checkpoints)")
    else:
        r.ok.append(f"disk: {need} fit the {free / 2**30:,.1f} GiB free at {where}")
