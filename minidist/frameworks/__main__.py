"""`python -m minidist.frameworks deepspeed|megatron|torchtitan ...`: print what a config means here (chapter 9)."""
from __future__ import annotations

import sys

from minidist import cli
from minidist import frameworks
from minidist.frameworks import from_deepspeed, from_megatron, from_torchtitan, words


# ----------------------------------------------------------------------------- the command line


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = cli.OneLineParser(prog="python -m minidist.frameworks", description=frameworks.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="framework", required=True)
    ds = sub.add_parser("deepspeed", help="a DeepSpeed JSON config")
    ds.add_argument("config", help="path of the JSON config")
    ds.add_argument("--pp", type=cli.integer(1), default=1, help="pipeline stages (PipelineModule(num_stages=...))")
    ds.add_argument("--tp", type=cli.integer(1), default=1, help="tensor-parallel degree (Megatron-DeepSpeed)")
    mg = sub.add_parser("megatron", help="a Megatron-LM argument line, after -- (or in --file)")
    mg.add_argument("--file", help="a file holding the argument line (a launch script's arguments)")
    tt = sub.add_parser("torchtitan", help="a torchtitan TOML job config")
    tt.add_argument("config", help="path of the TOML config (e.g. torchtitan's train_configs/llama3_8b.toml)")
    for flag in ("--n-layer", "--n-embd", "--n-head", "--block-size"):
        tt.add_argument(flag, type=cli.integer(1), help="the model minidist runs (torchtitan names its model by "
                                                        "flavor): as the demo's flag")
    for p in (ds, mg, tt):
        p.add_argument("--world", type=cli.integer(1), required=True, help="number of ranks (mpirun -n)")
    args = parser.parse_args(argv)
    try:
        if args.framework == "deepspeed":
            t = from_deepspeed(args.config, args.world, pp=args.pp, tp=args.tp)
        elif args.framework == "torchtitan":
            model = {name: getattr(args, name) for name in ("n_layer", "n_embd", "n_head", "block_size")
                     if getattr(args, name) is not None}
            t = from_torchtitan(args.config, args.world, settings=model)
        else:
            if args.file is None and not extra:
                raise ValueError("megatron: give the arguments after -- or in --file PATH")
            if args.file is not None:
                try:
                    with open(args.file) as f:
                        extra = words(f.read()) + extra
                except OSError as error:
                    raise ValueError(f"--file {args.file}: cannot read it ({error.strerror})") from None
                except UnicodeDecodeError:  # a ValueError whose words name no file: say which
                    raise ValueError(f"--file {args.file}: not a text file (Megatron-LM's arguments are UTF-8 "
                                     "text)") from None
            t = from_megatron(extra, args.world)
    except ValueError as error:
        parser.error(str(error))
    print(t.describe())
    print("\nmapped:", *(f"  {note}" for note in t.notes), sep="\n")
    print("\nnot supported:", *(f"  {why}" for why in t.unsupported or ["none"]), sep="\n")
    print("\nrun it:", f"  {t.command()}", sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
