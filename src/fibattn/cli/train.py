"""``fibattn train``: train a model from a preset (or a saved config) plus ``--set`` overrides."""
from __future__ import annotations

import logging
from pathlib import Path

from .. import config as C
from ..checks import check_int
from ..config import ConfigError, RunConfig
from ..config_files import load_all
from ..data.manifest import data_config
from ..devices import resolve_device
from ..files import check_creatable
from ..storage.init_source import naming
from ..trainer.distributed import starting
from ..trainer.init_recipe import apply_recipe
from ..trainer.init_weights import resumed_init
from ..trainer.trainer import TrainingAborted, train
from ..validation import check_honoured, fit_warmup, given_by_file, given_by_set, validate_given

log = logging.getLogger("fibattn")


def build_config(args, notes: list | None = None) -> RunConfig:
    """The run's config from the flags; what it says to the user goes to ``notes`` (logged now without)."""
    from ..presets import get_preset
    say = log.info if notes is None else notes.append
    if args.config and args.preset:
        raise ConfigError("give either --preset or --config, not both")
    origins: dict = {}
    if args.config:
        cfg, origins = load_all(args.config)      # repeated: merged in order, later files override
    else:
        cfg = get_preset(args.preset or "tiny")
    sets = list(args.set or [])
    keys = [s.split("=", 1)[0].strip() for s in sets]
    if getattr(args, "device", None) is not None:    # --device is --set train.device, given once
        if "train.device" in keys:
            raise ConfigError(f"--device {args.device} and --set train.device both choose the device; give one")
        sets, keys = sets + [f"train.device={args.device}"], keys + ["train.device"]
    if args.data:
        given = [k for k in keys if k.startswith("data.")]
        if given:
            raise ConfigError(f"--data {args.data} takes every data.* setting from the folder's manifest; drop "
                              f"--set {given[0]} (or prepare the data again with it)")
        cfg.data, manifest = data_config(args.data)
        if "model.vocab_size" not in keys:
            cfg.model.vocab_size = manifest["vocab_size"]
    if args.init_from is not None:                   # an empty --init-from is refused, never ignored
        init_architecture(cfg, args.init_from, keys)
    C.apply_overrides(cfg, sets)
    # named here: the fine-tuning recipe, where --set left it open
    if args.init_from is not None or "train.init_from" in keys:
        done = apply_recipe(cfg, set(keys))          # (a --config that already names a source is taken as it is)
        if done:
            say(f"fibattn: fine-tuning from {cfg.train.init_from}: {', '.join(done)} (docs/retrofit.md; --set "
                f"overrides)")
    if isinstance(cfg.data.out_dir, str) and cfg.data.out_dir.strip():
        cfg.data.out_dir = str(Path(cfg.data.out_dir).expanduser().absolute())   # eval works from any directory
    if args.out:
        cfg.train.out_dir = args.out
        if "name" not in keys:
            cfg.name = Path(args.out).resolve().name       # a run is named after its folder
    if args.data:                                    # the folder's data settings replace the files'
        origins = {k: v for k, v in origins.items() if not k.startswith("data.")}
    validate_given(cfg, origins, sets)
    given = {**given_by_file(cfg, origins), **given_by_set(sets)}
    check_honoured(cfg, given)
    note = fit_warmup(cfg.train, given)
    if note:
        say(note)
    return cfg


def init_architecture(cfg: RunConfig, spec: str, keys: list[str]) -> None:
    """``--init-from``: the source's architecture for every model.* field that fixes the parameters and is
    not given with --set."""
    from ..storage.init_source import absolute_spec, open_source
    source = open_source(spec, weights=False)
    for key, value in source.architecture.items():
        if f"model.{key}" not in keys:
            setattr(cfg.model, key, value)
    cfg.train.init_from = absolute_spec(spec)


def configure_parser(parser) -> None:
    parser.add_argument("--preset", choices=None, default=None, help="paper | tiny (default tiny)")
    parser.add_argument("--config", action="append", default=None, metavar="FILE.json|FILE.toml",
                        help="a config file: JSON (e.g. a run's config.json) or TOML; repeat to merge several in "
                             "order (a later file's values replace an earlier one's); --set overrides them")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. model.window=8 (repeat)")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="a folder from `fibattn prepare` (e.g. --files): its sources, tokenizer and vocabulary")
    parser.add_argument("--out", default=None, metavar="DIR", help="output folder (train.out_dir); names the run")
    parser.add_argument("--init-from", default=None, metavar="SOURCE",
                        help="start from trained weights (a run, RUN@STEP, a checkpoint, an export or a transformers "
                             "Llama folder): its architecture and the fine-tuning recipe are the defaults (see "
                             "docs/retrofit.md); --set overrides either")
    parser.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                        help="auto: continue from the newest verified checkpoint (default)")
    parser.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                        help="stop after this step with a checkpoint (resume later)")
    parser.add_argument("--device", default=None, metavar="auto|cpu|cuda|cuda:N",
                        help="where to train (train.device; default: the preset's, auto)")


def run(args) -> int:
    if args.device is not None:
        resolve_device(args.device)                # first: one line about the device, whatever else is wrong
    if args.stop_at is not None:
        check_int("--stop-at", args.stop_at, 1)
    if not args.resume.strip():                    # named as the flag here, not as train()'s argument
        raise ConfigError(f"--resume must be auto, never or a checkpoint folder, got {args.resume!r}")
    with naming("--init-from" if args.init_from is not None else "train.init_from"):    # errors name the flag
        notes: list = []
        with starting():                        # under torchrun: a rank's refusal reaches every rank
            cfg = build_config(args, notes)
            if args.out is not None:            # named as the flag given, and its field
                check_creatable(cfg.train.out_dir, "--out (train.out_dir)")
            if args.stop_at is not None and args.stop_at > cfg.train.steps:     # would silently run to the end
                raise ConfigError(f"--stop-at {args.stop_at} is beyond train.steps ({cfg.train.steps}): the run ends "
                                  f"first; give --stop-at <= {cfg.train.steps} or raise train.steps")
            if cfg.train.init_from and args.resume:
                resumed_init(cfg, args.resume)  # a refused --init-from / --resume pair is the only line printed
        for note in notes:
            log.info(note)
        try:
            result = train(cfg, resume=args.resume, stop_at=args.stop_at)
        except TrainingAborted as exc:
            print(f"fibattn train: aborted: {exc}", flush=True)
            return 1
    print(f"{result.status}: step {result.step} | {result.tokens} tokens | {result.elapsed_s:.1f}s training | "
          f"checkpoint {result.checkpoint}", flush=True)
    return 0
