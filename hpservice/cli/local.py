"""Commands that act on this machine: ``demo``, ``version``, ``run``, ``validate``, ``schema``,
``export``, ``prepare-data``, ``generate``."""

from __future__ import annotations

import sys

from hpservice.jobs import ExitCode


def add_parsers(sub) -> None:
    demo = sub.add_parser("demo", help="run the DTensor core demo on local gloo ranks")
    demo.add_argument("--ranks", type=int, default=4, help="number of local ranks (even, >= 2)")
    sub.add_parser("version", help="print the version")
    run = sub.add_parser("run", help="run a job on a local Ray (or --address) with a live progress bar")
    run.add_argument("job", help="the job's YAML file (docs/jobspec.md)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    run.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    validate = sub.add_parser("validate", help="check a job file; print its errors with field paths")
    validate.add_argument("job", help="the job's YAML file: the spec, the layout, the model and the input files are checked")
    validate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    validate.add_argument(
        "--device-memory",
        default=None,
        metavar="SIZE",
        help="memory of one worker's device (e.g. 80GiB) when the spec has no resources.device_memory: the job is "
        "refused if its estimated peak per rank exceeds it (plan a GPU job on a laptop: docs/memory.md)",
    )
    schema = sub.add_parser("schema", help="print the job spec's JSON Schema (for editor completion)")
    schema.add_argument("--markdown", action="store_true", help="a reference of every field instead (docs/jobspec.md)")
    export = sub.add_parser(
        "export",
        help="write a sharded checkpoint's full model weights: one .safetensors file, or a Hugging Face directory",
    )
    export.add_argument("checkpoint", help="a committed checkpoint directory (step-N)")
    export.add_argument("out", help="output .safetensors path, or directory with --format hf / peft")
    export.add_argument(
        "--format",
        choices=("safetensors", "hf", "peft"),
        default="safetensors",
        help="hf: config.json + sharded safetensors + index, for transformers' from_pretrained (a LoRA run's "
        "adapters merged in, in fp32); peft: a LoRA run's adapter, for peft.PeftModel.from_pretrained",
    )
    export.add_argument("--max-shard-mb", type=int, default=2048, help="hf: largest safetensors file (MiB)")
    export.add_argument(
        "--base",
        help="hf, a LoRA run: the Hugging Face base its adapters belong to, where it is mounted now (default: the "
        "run's model.init_from; its fingerprint must match)",
    )
    prep = sub.add_parser(
        "prepare-data", help="tokenize text / JSONL files into a token file (+ metadata) for data.kind: tokens"
    )
    prep.add_argument("inputs", nargs="+", help="*.jsonl (one object per line) or text files (one document each)")
    prep.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers tokenizer.json")
    prep.add_argument("--out", required=True, help="the token file to write (*.u32.bin for vocabularies > 65536)")
    prep.add_argument("--field", default="text", help="the JSONL field holding the document (default text)")
    prep.add_argument("--val-fraction", type=float, default=0.0, help="share of documents for the validation file: train.bin -> train-val.bin, train.u32.bin -> train-val.u32.bin")
    prep.add_argument("--eos-token", default=None, help="the token after each document (default: the tokenizer's end of text)")
    prep.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="first train a byte-level BPE tokenizer on the inputs and save it to --tokenizer",
    )
    prep.add_argument("--vocab-size", type=int, default=None, help="with --train-tokenizer: its vocabulary size")
    gen = sub.add_parser("generate", help="generate text from a checkpoint (ours, step-N, or a Hugging Face directory)")
    gen.add_argument("checkpoint", help="a committed step-N checkpoint directory, or a Hugging Face checkpoint directory")
    asked = gen.add_mutually_exclusive_group(required=True)
    asked.add_argument("--prompt", help="the text to continue")
    asked.add_argument(
        "--messages",
        help="a conversation (JSON list of {role, content}, inline or a file): rendered with the model's chat "
        "template and a generation prompt; prints the assistant's answer",
    )
    gen.add_argument(
        "--adapter",
        default=None,
        help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to apply to a Hugging "
        "Face checkpoint (a LoRA run's own step-N checkpoint carries its adapters already)",
    )
    gen.add_argument("--chat-template", default=None, help="with --messages: a template (inline or a .jinja file) instead of the model's")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="stop after this many tokens (default 32)")
    gen.add_argument("--tokenizer", default=None, help="tokenizer.json (default: byte-level, for 256-token models)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens only")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    demo.set_defaults(run=_demo)
    sub.choices["version"].set_defaults(run=_version)
    run.set_defaults(run=_run)
    validate.set_defaults(run=_validate)
    schema.set_defaults(run=_schema)
    export.set_defaults(run=_export)
    prep.set_defaults(run=_prepare_data)
    gen.set_defaults(run=_generate)


def _version(args) -> int:
    from hpservice import __version__

    print(__version__)
    return ExitCode.OK


def _demo(args) -> int:
    from hpservice.demo import run_demo

    return run_demo(args.ranks)


def _run(args) -> int:
    spec = load_launchable(args, here=args.address is None)
    if spec is None:
        return ExitCode.USAGE
    auto = (spec.memory_estimate or {}).get("auto")
    if auto:
        print(f"parallelism: auto chose {auto['chosen']} (runner-up: {auto['runner_up']})", flush=True)
    if spec.training.compile and args.address is None:  # the workers run on this machine: check it now
        import torch

        from hpservice.train._compile import check_compile_available

        device = "cuda" if spec.resources.gpus_per_worker(torch.cuda.device_count()) else "cpu"
        if reason := check_compile_available(device):
            print(f"{args.job}: {reason}", file=sys.stderr)
            return ExitCode.USAGE
    from hpservice.run_local import run_job

    return run_job(spec, address=args.address)


def _validate(args) -> int:
    spec = load_launchable(args, devices_here=False)  # it plans: the job's devices may be elsewhere
    if spec is None:
        return ExitCode.USAGE
    from hpservice.models import resolve_name

    m = spec.model
    name = resolve_name(m.name, m.init_from)
    if m.init_from:
        model = f"{name} from {m.init_from}"
    else:
        model = name if ":" in name else f"{name}/{m.flavor or 'tiny'}"
    print(f"{args.job}: valid job {spec.name!r} ({model}, {spec.training.steps} steps)")
    _print_estimate(spec.memory_estimate)
    return ExitCode.OK


def _print_estimate(record: dict | None) -> None:
    if record is None:
        return
    auto = record.get("auto")
    if auto:
        print(f"parallelism: auto chose {auto['chosen']} (estimated step {auto['chosen_step_s']:.3g} s)")
        if auto["runner_up"]:
            print(f"  runner-up: {auto['runner_up']} (estimated step {auto['runner_up_step_s']:.3g} s)")
        print(f"  why: {auto['why']}")
    memory = record.get("device_memory_gib")
    against = f" of {memory:,.2f} GiB per device" if memory else ""
    print(f"estimated peak memory per rank: {record['peak_gib']:,.2f} GiB{against} ({record['device']}, micro-batch {record['micro_batch']})")
    for rank in record["ranks"]:
        print(f"  {rank['ranks']}: {rank['peak_gib']:,.2f} GiB at its peak ({rank['phase']})")
        for name, value in rank["components_gib"].items():
            print(f"    {name:<36}{value:>10,.3f} GiB")
    for line in record["assumptions"]:
        print(f"  assumes: {line}")


def _schema(args) -> int:
    import json

    from hpservice.spec import JobSpec, fields_reference

    print(fields_reference() if args.markdown else json.dumps(JobSpec.model_json_schema(by_alias=True), indent=2), end="")
    return ExitCode.OK


def _export(args) -> int:
    from hpservice.checkpoint import CheckpointError, export_safetensors
    from hpservice.models.hf import HFFormatError, export_checkpoint_hf

    try:
        if args.format == "hf":
            done = export_checkpoint_hf(args.checkpoint, args.out, max_shard_bytes=args.max_shard_mb << 20, base=args.base)
            print(f"wrote {done['tensors']} tensors in {len(done['files'])} files and config.json to {args.out}")
            return ExitCode.OK
        if args.format == "peft":
            from hpservice.models.hf import export_checkpoint_peft

            done = export_checkpoint_peft(args.checkpoint, args.out)
            print(f"wrote a PEFT adapter ({done['tensors']} tensors) to {args.out}")
            return ExitCode.OK
        shapes = export_safetensors(args.checkpoint, args.out)
    except (CheckpointError, HFFormatError, FileNotFoundError) as e:
        print(f"hpservice export: {e}", file=sys.stderr)
        return ExitCode.FAILED
    print(f"wrote {len(shapes)} tensors to {args.out}")
    return ExitCode.OK


def load_launchable(args, *, here: bool = True, devices_here: bool | None = None, plan: bool = True):
    """The job file with ``--set`` overrides, checked as far as it can be before anything starts
    (``hpservice.preflight``: the layout everywhere; for a job run on this machine, ``here``, also
    its model, its input files and its GPU), with its memory estimate and, for ``parallelism:
    auto``, its layout (``plan_memory``; not with ``plan=False``: ``submit`` leaves that to the
    server, which knows the cluster's devices); None after printing why."""
    from hpservice.preflight import job_device, plan_memory, preflight
    from hpservice.spec import SpecError, load_job, parse_device_memory

    try:
        spec = load_job(args.job, args.set)
        preflight(spec, source=args.job, here=here, devices_here=devices_here)
        if not plan:
            return spec
        import torch

        memory = getattr(args, "device_memory", None)
        try:
            memory = parse_device_memory(memory) if memory is not None else None
        except ValueError as e:
            raise SpecError(f"--device-memory: {e}") from None
        device = job_device(spec, bool(here and devices_here is not False) and torch.cuda.device_count() >= spec.resources.workers)
        spec = plan_memory(spec, device_memory=memory, device=device, source="--device-memory")
    except SpecError as e:
        print(e, file=sys.stderr)
        return None
    return spec


def _load_for_generation(path: str, adapter: str | None = None):
    """A plain model of one of the Hugging Face families with the weights of ``path`` and its
    ``hf_text`` record (special ids, tokenizer files; None where there is none): our checkpoint
    (its recorded model and config; a LoRA run's with its adapters, on the base it records when the
    checkpoint holds the adapters only) or a Hugging Face directory (the family its config names),
    with a PEFT ``adapter`` applied."""
    from pathlib import Path

    from hpservice.checkpoint import CheckpointReader
    from hpservice.models import HF_FAMILIES, build_model, config_class, model_class
    from hpservice.models.hf import base_fingerprint, load_hf_weights
    from hpservice.models.hf_text import record_from_hf
    from hpservice.models.lora import LoraSettings, apply_lora
    from hpservice.models.peft_adapter import load_adapter, read_adapter_config, settings_from_config

    p = Path(path)
    if (p / "config.json").is_file():
        model = build_model(None, init_from=str(p))
        if adapter is not None:
            apply_lora(model, settings_from_config(read_adapter_config(adapter), adapter))
        load_hf_weights(model, p)
        if adapter is not None:
            load_adapter(model, adapter)
        return model, record_from_hf(p)
    if adapter is not None:
        raise ValueError("--adapter applies to a Hugging Face checkpoint; a LoRA run's step-N checkpoint has its own")
    checkpoint = CheckpointReader(p)  # an input: read, never written, nothing in it runs
    recorded = checkpoint.extra(0).get("model") or {}
    if recorded.get("name") not in HF_FAMILIES or not recorded.get("config"):
        raise ValueError(f"{p}: not a checkpoint of {', '.join(HF_FAMILIES)} with its config recorded")
    model = model_class(recorded["name"])(config_class(recorded["name"])(**recorded["config"]))
    lora = recorded.get("lora")
    if lora is None:
        checkpoint.load(model)
        return model, recorded.get("text")
    fields = {"r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora"}
    settings = {k: (tuple(v) if isinstance(v, list) else v) for k, v in lora.items() if k in fields}
    apply_lora(model, LoraSettings(**settings))
    adapters_only = lora.get("base_fingerprint") is not None  # the frozen base is model.init_from's
    if adapters_only:
        if base_fingerprint(lora["base"]) != lora["base_fingerprint"]:
            raise ValueError(f"{p}: its adapters were trained on {lora['base']!r}, which now holds another model")
        load_hf_weights(model, lora["base"])
        for name, param in model.named_parameters():
            param.requires_grad_(name.endswith((".lora_A", ".lora_B")))
    checkpoint.load(model, ignore_frozen_params=adapters_only)
    return model, recorded.get("text")


def _generate(args) -> int:
    from hpservice.data import ByteTokenizer
    from hpservice.models.generate import generate
    from hpservice.models.hf_text import stop_ids

    try:
        model, text = _load_for_generation(args.checkpoint, args.adapter)
        files = (text or {}).get("files") or {}
        if args.tokenizer or "tokenizer.json" in files:  # --tokenizer, else the one the model came with
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(args.tokenizer) if args.tokenizer else Tokenizer.from_str(files["tokenizer.json"])
            # the prompt as transformers' tokenizer gives it: with the tokenizer's BOS (Llama 3's)
            encode, decode = (lambda prompt: tok.encode(prompt, add_special_tokens=True).ids), tok.decode
            stops = stop_ids(text, tok)
            if args.messages is not None:
                prompt, chat_stops = _chat_prompt(args, files)
                args.prompt = ""
                stops |= {i for t in chat_stops if (i := tok.token_to_id(t)) is not None}
                # the template writes every special token itself: encoded as apply_chat_template does
                encode = lambda _: tok.encode(prompt, add_special_tokens=False).ids  # noqa: E731
        elif args.messages is not None:
            print("hpservice generate: --messages needs a tokenizer with a chat template (--tokenizer, or the model's)", file=sys.stderr)
            return 2
        elif model.cfg.vocab_size == 256:
            byte = ByteTokenizer()
            encode, decode, stops = byte.encode, byte.decode, set()
        else:
            print(f"hpservice generate: a {model.cfg.vocab_size}-token model needs --tokenizer", file=sys.stderr)
            return 2
        ids = generate(
            model, list(encode(args.prompt)), args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, seed=args.seed, stop_ids=stops,
        )  # fmt: skip
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hpservice generate: {e}", file=sys.stderr)
        return 1
    print(args.prompt + decode(ids))
    return 0


def _chat_prompt(args, files: dict) -> tuple[str, list[str]]:
    """(the conversation rendered with a generation prompt, the end-of-turn tokens to stop at)."""
    import json
    from pathlib import Path

    from hpservice.data.chat import ChatTemplate, to_conversation
    from hpservice.data.chat._encode import _SPECIAL_KEYS, _token_str, template_text

    raw = args.messages
    messages = json.loads(Path(raw).read_text() if not raw.lstrip().startswith("[") else raw)
    config = json.loads(files.get("tokenizer_config.json") or "{}")
    if args.tokenizer:  # a tokenizer.json: its config beside it
        beside = Path(args.tokenizer).with_name("tokenizer_config.json")
        config = json.loads(beside.read_text()) if beside.is_file() else {}
    source = template_text(args.chat_template) or files.get("chat_template.jinja") or config.get("chat_template")
    if not source:
        raise ValueError("--messages: the model's tokenizer has no chat template; give one with --chat-template")
    special = {k: s for k in _SPECIAL_KEYS if (s := _token_str(config.get(k))) is not None}
    conv = to_conversation({"messages": messages}, "messages", {}, "assistant")
    prompt = ChatTemplate(source, special).render(conv.messages, add_generation_prompt=True).text
    return prompt, [special["eos_token"]] if "eos_token" in special else []


def _prepare_data(args) -> int:
    from hpservice.data import DataPrepError, prepare_data, train_tokenizer

    try:
        if args.train_tokenizer:
            if not args.vocab_size:
                print("hpservice prepare-data: --train-tokenizer needs --vocab-size", file=sys.stderr)
                return 2
            train_tokenizer(args.inputs, args.tokenizer, args.vocab_size, field=args.field)
            print(f"trained a {args.vocab_size}-token BPE tokenizer: {args.tokenizer}")
        written = prepare_data(
            args.inputs,
            args.out,
            args.tokenizer,
            field=args.field,
            val_fraction=args.val_fraction,
            eos_token=args.eos_token,
            progress=sys.stderr.isatty(),
        )
    except (DataPrepError, OSError) as e:
        print(f"hpservice prepare-data: {e}", file=sys.stderr)
        return 1
    for split, meta in written.items():
        print(f"{split}: {meta['tokens']} tokens of {meta['documents']} documents -> {meta['path']} ({meta['dtype']})")
    return 0


