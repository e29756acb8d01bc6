"""``async-vapo make-base``: build (or reuse: cached, else shipped) the embedded tiny base model."""

from __future__ import annotations

import argparse
import shutil

from async_vapo.cli._common import add_config_args, load


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("make-base", help="build (or reuse) the embedded tiny base model")
    add_config_args(p)
    p.add_argument("--force", action="store_true",
                   help="rebuild the base model (and the reward-like critic) even if cached or shipped")
    p.add_argument("--ship", action="store_true",
                   help="then make these builds the ones shipped in the package (async_vapo/models/shipped/)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    make_base(load(args), force=args.force, ship=args.ship, command=" ".join(["async-vapo", *args.argv]))
    return 0


def make_base(cfg, *, force: bool, ship: bool, command: str) -> None:
    """Build (or reuse: cached, else shipped) the base model and, with ``model.critic_init = "reward"``, the
    reward-like critic; print their paths. ``force``: build both anew. ``ship``: copy them into the package."""
    from async_vapo.models.base_model import base_model_key, base_model_path, ensure_base_model
    from async_vapo.models.base_model import make_base as build_base
    from async_vapo.models.reward import make_reward_critic, resolve_critic_path, reward_critic_key, reward_critic_path

    path = build_base(cfg, base_model_path(cfg)) if force else ensure_base_model(cfg)
    print(path)
    if force and not cfg.model.critic_path and resolve_critic_path(cfg, path, build=False) is not None:
        shutil.rmtree(reward_critic_path(cfg), ignore_errors=True)
        critic = make_reward_critic(cfg, path, reward_critic_path(cfg))
    else:
        critic = resolve_critic_path(cfg, path)  # model.critic_init = "reward": its head is built here too
    if critic is not None:
        print(critic)
    if ship:
        from async_vapo.models.ship import ship as ship_models

        models = {"base": (base_model_key(cfg), path)}
        if critic is not None:
            models["reward_critic"] = (reward_critic_key(cfg), critic)
        print(ship_models(models, recipe=command))
