"""``fibattn export``: write a run's checkpoint as a portable, verified model folder."""
from __future__ import annotations

from ..storage import pretrained as hub
from ..storage.export import export_run
from ..storage.runs import parse_step


def configure_parser(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN", help="a training run folder (or one checkpoint folder)")
    parser.add_argument("out_dir", metavar="OUT", help="the folder to write (must be new or empty)")
    parser.add_argument("--step", default="latest", help="checkpoint step (default: latest)")
    parser.add_argument("--format", default="fibattn", choices=("fibattn", "hf"),
                        help="fibattn (default): fibattn's verified folder; hf: a transformers Llama folder "
                             "(load with fibattn.interop.hf_llama.from_pretrained to keep the sparse attention)")
    parser.add_argument("--force", action="store_true",
                        help="replace an earlier export in OUT: only the files its config.json lists are replaced "
                             "or removed; anything else in OUT is kept")


def run(args) -> int:
    if args.format == "hf":
        if args.force:
            from ..config import ConfigError
            raise ConfigError("--force applies to --format fibattn only; --format hf writes a new or empty folder")
        from ..interop.hf_export import export_hf
        try:
            out = export_hf(args.run_dir, args.out_dir, step=parse_step(args.step))
        except ImportError as exc:
            from ..config import ConfigError
            raise ConfigError(str(exc)) from None
        print(f"fibattn export: wrote {out} (transformers Llama; sparse attention in config.fibattn: load it with "
              f"fibattn.interop.hf_llama.from_pretrained)")
        return 0
    out = export_run(args.run_dir, args.out_dir, step=parse_step(args.step), force=args.force)
    meta = hub.read_meta(out)
    print(f"fibattn export: wrote {out} ({', '.join(sorted(meta['files']))}, {hub.CONFIG}); "
          f"step {meta['source']['step']}, {meta['num_params']:,} parameters")
    return 0
