"""The packlora command line: a thin layer over the Python API."""
import argparse
import json
import signal
import sys
import traceback
import warnings

from .adapters import load_adapter
from .adapters.peft_io import check_adapter_path
from .adapters.deltas import BASES
from .config import resolve_config
from .data.formats import check_fields
from .device import Device
from .errors import ConfigError, PackloraError
from .evaluate import exact_match, read_eval_records
from .export import export_model
from .generate import generate
from .gguf_out.adapter import OUTTYPES, export_gguf_adapter
from .gguf_out.merge import TARGETS as GGUF_TARGETS
from .gguf_out.merge import merge_to_gguf
from .inspect_model import inspect_report
from .memory.fit import check_fits
from .memory.report import run_memory_report
from .models import load_model
from .quant import FORMATS
from .quant.registry import DOUBLE_QUANT_FORMATS
from .quant.presets import PRESETS
from .training import finetune
from .training.distributed import World, launched_ranks

# The formats --quant takes, the QLoRA default first, as the registry lists them.
_QUANT_HELP = ", ".join(f"{f} (default)" if f == "nf4" else f
                        for f in (*FORMATS, *PRESETS, "none"))
_DEBUG_HELP = "print the full traceback of an unexpected error"
_DEVICE_HELP = "cpu (the default), cuda or cuda:N"
_MODEL_HELP = "model name, HF folder, GGUF file or ollama:NAME (a model pulled with Ollama)"
_PEFT_HELP = "a run's output folder, a checkpoint, or a PEFT-format adapter folder"
_ADAPTER_HELP = f"{_PEFT_HELP}; or a llama.cpp LoRA GGUF"
_MAX_NEW_HELP = ("at most this many new tokens (default %(default)s); generation also stops at "
                 "the end of the model's context")


def _cmd_finetune(a):
    cfg = resolve_config(a.config, a.overrides)  # once, for the check and the run
    if not a.no_memory_check:  # before anything loads: a run that cannot fit is killed mid-way
        check_fits(cfg, ranks=launched_ranks())
    res = finetune(cfg, progress=not a.quiet)
    if res.rank != 0:
        return  # rank 0 says what the run wrote
    last = res.history[-1] if res.history else {}
    print(json.dumps({"output_dir": str(res.output_dir), "steps": len(res.history),
                      "final_loss": last.get("loss"), "eval_loss": last.get("eval_loss")}))


def _load(a):
    dev = Device.parse(a.device)
    if getattr(a, "adapter", None):
        check_adapter_path(a.adapter)  # a mistyped path, before a base model loads
    model = load_model(a.model, dev, quant=a.quant)
    if getattr(a, "adapter", None):
        load_adapter(model, a.adapter)
    return model


def _cmd_generate(a):
    model = _load(a)
    prompt = [{"role": "user", "content": a.prompt}] if not a.no_chat else a.prompt
    print(generate(model, prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                   top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                   int8_activations=not a.float_activations))


def _fields(pairs):
    """eval's --field KEY=RECORD_KEY pairs as data.fields' mapping, checked."""
    fields = {}
    for pair in pairs or ():
        ours, sep, theirs = pair.partition("=")
        if not sep:
            raise ConfigError(f"--field {pair!r}: expected KEY=RECORD_KEY, e.g. prompt=question")
        fields[ours] = theirs
    try:
        return check_fields(fields)
    except ValueError as exc:
        raise ConfigError(f"--field {exc}") from None


def _cmd_eval(a):
    records = read_eval_records(a.data, _fields(a.field))  # data errors before a model loads
    model = _load(a)
    show = (lambda got, want, ok: print(f"OK  {got}" if ok else f"BAD {got!r}, expected "
                                        f"{want!r}", flush=True)) if a.verbose else None
    print(json.dumps(exact_match(model, records, a.max_new_tokens, a.limit, show)))


def _cmd_merge(a):
    if a.out.lower().endswith(".gguf"):
        if a.dtype is not None:  # was ignored: the GGUF kept each weight's type
            raise ConfigError(f"--dtype {a.dtype} sets an HF folder's float type; a .gguf output "
                              "takes --quantize f32, f16 or bf16")
        out = merge_to_gguf(a.model, a.adapter, a.out, quantize_to=a.quantize, base_mode=a.base)
    else:
        out = export_model(a.model, a.out, adapter=a.adapter, dtype=a.dtype or "float32",
                           quantize=a.quantize, base_mode=a.base)
    print(f"wrote {out}")


def _cmd_export_gguf(a):
    out = export_gguf_adapter(a.adapter, a.out, model=a.model, outtype=a.outtype)
    print(f"wrote {out}")


def _cmd_quantize(a):
    out = export_model(a.source, a.out_dir, quantize=a.format, block_size=a.block_size,
                       double_quant=a.double_quant)
    print(f"wrote {out}")


def _cmd_inspect(a):
    print(json.dumps(inspect_report(a.model, a.quant), indent=2) if a.json
          else inspect_report(a.model, a.quant, text=True))


def _cmd_memory_report(a):
    run_memory_report(a)


def _model_args(p, adapter=True):
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--device", default="cpu", help=_DEVICE_HELP)
    p.add_argument("--quant", default=None, help=_QUANT_HELP)
    if adapter:
        p.add_argument("--adapter", default=None, help=_ADAPTER_HELP)


def _config_args(p):
    p.add_argument("config", help="the run's YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of the config")


def _finetune_args(p):
    _config_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--no-memory-check", action="store_true",
                   help="start even where the run's planned RAM exceeds what is available")


def _memory_report_args(p):
    _config_args(p)
    p.add_argument("--measure", action="store_true",
                   help="also train a few steps on random batches of the planned shape and "
                        "measure them beside the plan")
    p.add_argument("--steps", type=int, default=2, help="steps --measure measures (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", default=None, help="draw it to this .png, .svg or .pdf file")
    p.add_argument("--ranks", type=int, default=1,
                   help="plan one rank of a data-parallel run over this many (mpiexec -n N)")


def _generate_args(p):
    _model_args(p)
    p.add_argument("--prompt", required=True,
                   help="a user message, rendered with the chat template unless --no-chat")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help=_MAX_NEW_HELP)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default) takes the most likely token; above 0 samples")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities add up to "
                        "this (default 1: all)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=None,
                   help="the sampling seed, for a repeatable sample (default: a fresh one)")
    p.add_argument("--float-activations", action="store_true",
                   help="decode with float32 activations in every packed product (slower; by "
                        "default the one-token steps round them to 8 bits, as llama.cpp does)")


def _eval_args(p):
    _model_args(p)
    p.add_argument("--data", required=True,
                   help="a JSONL file of chat, alpaca or completion records; each chat "
                        "record's last assistant message is the answer expected from the "
                        "messages before it, each completion the answer to its prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help=_MAX_NEW_HELP)
    p.add_argument("--limit", type=int, default=None, help="score the first N records only")
    p.add_argument("--field", action="append", metavar="KEY=RECORD_KEY",
                   help="read a format's KEY from the records' RECORD_KEY, as data.fields does "
                        "(repeatable), e.g. --field prompt=question --field completion=answer")
    p.add_argument("--verbose", action="store_true", help="print every answer, OK or BAD")


def _merge_args(p):
    p.add_argument("--model", required=True, help="the base: " + _MODEL_HELP)
    p.add_argument("--adapter", required=True, help=_ADAPTER_HELP)
    p.add_argument("--out", required=True,
                   help="a new folder (HF layout), or a new .gguf file for llama.cpp / Ollama")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="float type of an HF folder's weights (default float32; a .gguf takes "
                        "--quantize f32|f16|bf16)")
    p.add_argument("--quantize", default=None,
                   help="HF folder: write packed weights in this format; .gguf: the linear "
                        f"weights' type ({', '.join(GGUF_TARGETS)}; default: each keeps its "
                        "type from a GGUF base, f16 from an HF base), and of a float "
                        "embedding and head (a preset: llama.cpp's picks; a type: q8_0)")
    p.add_argument("--base", default=None, choices=list(BASES),
                   help="what a float base weight takes the adapter on: float = the original W "
                        "(PEFT's merge, what the QLoRA authors recommend; the default), "
                        "quantized = deq(Q(W)), the weights a QLoRA adapter was trained "
                        "against, for an exact reproduction (the default for LoftQ adapters, "
                        "which are fitted to W - deq(Q(W))). Quantized GGUF weights are "
                        "already what the adapter was trained on")


def _export_gguf_args(p):
    p.add_argument("adapter", help=_PEFT_HELP)
    p.add_argument("--out", required=True, help="the .gguf file to write (must not exist)")
    p.add_argument("--model", default=None,
                   help="the base it will run on (default: the adapter's base_model_name_or_path)")
    p.add_argument("--outtype", default="f32", choices=list(OUTTYPES),
                   help="the type of the adapter's tensors (default f32)")


def _quantize_args(p):
    p.add_argument("source", help=_MODEL_HELP)
    p.add_argument("out_dir", help="the folder to write (new, or empty)")
    p.add_argument("--format", default="nf4", help=f"the packed format: {_QUANT_HELP}")
    p.add_argument("--block-size", type=int, default=None,
                   help="values per quantization block (default: the format's)")
    p.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=None,
                   help="quantize the block scales too (default: on for "
                        f"{', '.join(DOUBLE_QUANT_FORMATS)})")


def _inspect_args(p):
    p.add_argument("model", help=_MODEL_HELP)
    p.add_argument("--quant", default=None, help=f"the format it would load in: {_QUANT_HELP}")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


# The subcommands: (name, help, its arguments, what runs it), in the order --help lists them.
_COMMANDS = (
    ("finetune", "fine-tune from a YAML config", _finetune_args, _cmd_finetune),
    ("memory-report", "plan (and measure) the memory of a run", _memory_report_args,
     _cmd_memory_report),
    ("generate", "generate text", _generate_args, _cmd_generate),
    ("eval", "held-out exact match on a JSONL file of prompts and answers", _eval_args, _cmd_eval),
    ("merge", "merge an adapter into the base: an HF folder, or one GGUF file", _merge_args,
     _cmd_merge),
    ("export-gguf", "write a LoRA adapter as a llama.cpp adapter GGUF (--lora)",
     _export_gguf_args, _cmd_export_gguf),
    ("quantize", "write a packed model that loads without re-quantizing", _quantize_args,
     _cmd_quantize),
    ("inspect", "architecture, parameters, tensor formats, bytes", _inspect_args, _cmd_inspect),
)


def build_parser():
    ap = argparse.ArgumentParser(prog="packlora", description=__doc__)
    ap.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    debug = argparse.ArgumentParser(add_help=False)  # --debug also after the subcommand
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=_DEBUG_HELP)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help, add_args, fn in _COMMANDS:
        p = sub.add_parser(name, help=help, parents=[debug])
        add_args(p)
        p.set_defaults(fn=fn)
    return ap


def main(argv=None):
    """The packlora command. Under an MPI launcher, a rank that fails ends every rank: the
    others would otherwise wait for it in the next collective forever."""
    try:
        world = World.detect()
    except PackloraError as e:
        print(f"packlora: error: {e}", file=sys.stderr)
        return 2
    try:
        code = _run(argv)
    except SystemExit as e:  # argparse's usage errors: end the other ranks too
        if e.code and world.size > 1:
            world.abort(e.code if isinstance(e.code, int) else 2)
        raise
    if code and world.size > 1:
        world.abort(code)
    return code


def _warn_one_line(message, category, filename, lineno, file=None, line=None):
    print(f"packlora: warning: {message}", file=sys.stderr)


def _terminated(signum, frame):
    """SIGTERM (a scheduler, `kill`) ends a command as Ctrl-C does: files being written are
    removed, nothing complete is touched."""
    raise KeyboardInterrupt


def parse_args(argv=None):
    """The parsed command line. `key.path=value` overrides may also follow the flags
    (`finetune run.yaml --quiet train.lr=1e-4`): argparse ends a positional list at a flag."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x
                                                 for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _run(argv):
    args = parse_args(argv)
    warnings.showwarning = _warn_one_line
    signal.signal(signal.SIGTERM, _terminated)
    try:
        args.fn(args)
    except PackloraError as e:
        print(f"packlora: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a path that is a file, ...: "path: reason"
        said = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        print(f"packlora: error: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM: what the run keeps, when it says
        print("packlora: interrupted" + (f"; {e}" if e.args else ""), file=sys.stderr)
        return 130
    except Exception as e:  # not one of ours: a bug; one line unless --debug
        if args.debug:
            traceback.print_exc()
        where = f" in {e.filename}" if getattr(e, "filename", None) else ""
        print(f"packlora: internal error{where}: {type(e).__name__}: {e} -- this is a bug, "
              "please report it (run with --debug for the traceback)", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
