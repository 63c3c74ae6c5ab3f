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
                        help="fibattn (default): fibattn's verified folder; hf: a transformers folder (a sparse "
                             "model as remote code: trust_remote_code=True, or fibattn.interop.hf_llama."
                             "from_pretrained for fibattn's op; a dense model as a plain Llama)")
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
        if (out / "modeling_fibattn_llama.py").is_file():
            print(f"fibattn export: wrote {out} (transformers remote code: AutoModelForCausalLM.from_pretrained(OUT, "
                  f"trust_remote_code=True), or fibattn.interop.hf_llama.from_pretrained(OUT) for fibattn's op)")
        else:
            print(f"fibattn export: wrote {out} (a dense model: a plain transformers Llama)")
        return 0
    out = export_run(args.run_dir, args.out_dir, step=parse_step(args.step), force=args.force)
    meta = hub.read_meta(out)
    print(f"fibattn export: wrote {out} ({', '.join(sorted(meta['files']))}, {hub.CONFIG}); "
          f"step {meta['source']['step']}, {meta['num_params']:,} parameters")
    return 0
