"""The ``hpservice`` command line.

Local commands: ``demo``, ``version``, ``run``, ``validate``, ``schema``, ``export``, ``prepare-data``,
``generate``, ``serve``. Commands
that talk to a running control plane (``hpservice serve``) over HTTP: ``submit``, ``list``,
``status``, ``watch``, ``logs``, ``cancel``, ``checkpoints``, ``artifacts``, ``delete``; each takes ``--url``
(default ``HPSERVICE_URL``, else ``http://127.0.0.1:8000``), ``--token`` (default
``HPSERVICE_TOKEN``) and ``--json`` (machine-readable output).

Exit codes, for scripts: ``hpservice.jobs.ExitCode`` (``hpservice --help`` lists them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hpservice.jobs import EXIT_CODES_HELP, EXIT_FOR_STATE, TERMINAL_STATES, ExitCode, JobState, print_summary

_POLL_INTERVAL_S = 1.0  # watch / logs -f polling when the event stream is unavailable



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hpservice",
        description="Distributed training service.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from hpservice import __version__

    parser.add_argument("--version", action="version", version=f"hpservice {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the DTensor core demo on local gloo ranks")
    demo.add_argument("--ranks", type=int, default=4, help="number of local ranks (even, >= 2)")
    sub.add_parser("version", help="print the version")
    run = sub.add_parser("run", help="run a job on a local Ray (or --address) with a live progress bar")
    run.add_argument("job")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    run.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    validate = sub.add_parser("validate", help="check a job file; print its errors with field paths")
    validate.add_argument("job")
    validate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    sub.add_parser("schema", help="print the job spec's JSON Schema (for editor completion)")
    export = sub.add_parser(
        "export",
        help="write a sharded checkpoint's full model weights: one .safetensors file, or a Hugging Face directory",
    )
    export.add_argument("checkpoint", help="a committed checkpoint directory (step-N)")
    export.add_argument("out", help="output .safetensors path, or directory with --format hf")
    export.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="hf: config.json + sharded safetensors + index, for transformers' from_pretrained (llama)",
    )
    export.add_argument("--max-shard-mb", type=int, default=2048, help="hf: largest safetensors file (MiB)")
    prep = sub.add_parser(
        "prepare-data", help="tokenize text / JSONL files into a token file (+ metadata) for data.kind: tokens"
    )
    prep.add_argument("inputs", nargs="+", help="*.jsonl (one object per line) or text files (one document each)")
    prep.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers tokenizer.json")
    prep.add_argument("--out", required=True, help="the token file to write (*.u32.bin for vocabularies > 65536)")
    prep.add_argument("--field", default="text", help="the JSONL field holding the document (default text)")
    prep.add_argument("--val-fraction", type=float, default=0.0, help="share of documents for <out>-val.bin")
    prep.add_argument("--eos-token", default=None, help="the separator between documents (default: the tokenizer's)")
    prep.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="first train a byte-level BPE tokenizer on the inputs and save it to --tokenizer",
    )
    prep.add_argument("--vocab-size", type=int, default=None, help="with --train-tokenizer: its vocabulary size")
    gen = sub.add_parser("generate", help="generate text from a checkpoint (ours, step-N, or a Hugging Face directory)")
    gen.add_argument("checkpoint", help="a committed step-N checkpoint directory, or a Hugging Face checkpoint directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--tokenizer", default=None, help="tokenizer.json (default: byte-level, for 256-token models)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=0)
    serve = sub.add_parser("serve", help="run the REST control plane (FastAPI) with a local Ray or --ray-address")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs API tokens)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", default=None, help="store directory (default HPSERVICE_DATA_DIR or ~/.hpservice)")
    serve.add_argument(
        "--ray-address", default=None, help="Ray cluster (default RAY_ADDRESS, else an embedded local Ray)"
    )
    serve.add_argument("--tokens-file", default=None, help="YAML {TOKEN: {owner, admin}}; also HPSERVICE_TOKENS")
    serve.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="MODULE:FACTORY",
        help="a model factory job specs may name (repeatable; also HPSERVICE_MODEL_FACTORIES and the "
        "hpservice.models entry points); others are refused",
    )
    serve.add_argument(
        "--data-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory job specs may read input files from (repeatable; also HPSERVICE_DATA_ROOTS); "
        "without one, jobs read no files",
    )
    serve.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs the embedded Ray head offers jobs (default: this machine's cores)"
    )
    serve.add_argument("--num-gpus", type=int, default=None, help="GPUs the embedded Ray head offers (default: Ray's count)")
    serve.add_argument("--no-docs", action="store_true", help="do not serve /docs, /redoc and /openapi.json")
    serve.add_argument(
        "--stop-ray",
        action="store_true",
        help="end the local Ray head a server with this --data-dir started (and the jobs on it), then exit",
    )
    _add_service_commands(sub)
    args = parser.parse_args(argv)

    if args.command in _SERVICE_COMMANDS:
        return _run_service_command(args)

    if args.command == "serve" and args.stop_ray:
        from hpservice.serve import stop_ray

        return stop_ray(args.data_dir)
    if args.command == "serve":
        from hpservice.serve import serve as run_server

        return run_server(
            args.host,
            args.port,
            args.data_dir,
            args.ray_address,
            args.tokens_file,
            allow_models=args.allow_model,
            data_roots=args.data_root,
            docs=not args.no_docs,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
        )
    if args.command == "version":
        from hpservice import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        from hpservice.demo import run_demo

        return run_demo(args.ranks)
    if args.command == "run":
        spec = _load_launchable(args)
        if spec is None:
            return ExitCode.USAGE
        if spec.training.compile and args.address is None:  # the workers run on this machine: check it now
            import torch

            from hpservice.train._compile import check_compile_available

            gpu = spec.resources.use_gpu
            device = "cuda" if gpu is True or (gpu == "auto" and torch.cuda.is_available()) else "cpu"
            if reason := check_compile_available(device):
                print(f"{args.job}: {reason}", file=sys.stderr)
                return 2
        from hpservice.run_local import run_job

        return run_job(spec, address=args.address)
    if args.command == "validate":
        spec = _load_launchable(args)
        if spec is None:
            return ExitCode.USAGE
        print(
            f"{args.job}: valid job {spec.name!r} ("
            + (f"llama from {spec.model.init_from}" if spec.model.init_from else f"{spec.model.name}/{spec.model.flavor}")
            + f", {spec.training.steps} steps)"
        )
        return 0
    if args.command == "schema":
        import json

        from hpservice.spec import JobSpec

        print(json.dumps(JobSpec.model_json_schema(by_alias=True), indent=2))
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "prepare-data":
        return _prepare_data(args)
    if args.command == "export":
        from hpservice.checkpoint import CheckpointError, export_safetensors
        from hpservice.models.hf import HFFormatError, export_checkpoint_hf

        try:
            if args.format == "hf":
                done = export_checkpoint_hf(args.checkpoint, args.out, max_shard_bytes=args.max_shard_mb << 20)
                print(f"wrote {done['tensors']} tensors in {len(done['files'])} files and config.json to {args.out}")
                return 0
            shapes = export_safetensors(args.checkpoint, args.out)
        except (CheckpointError, HFFormatError, FileNotFoundError) as e:
            print(f"hpservice export: {e}", file=sys.stderr)
            return 1
        print(f"wrote {len(shapes)} tensors to {args.out}")
        return 0
    parser.error(f"unknown command {args.command}")  # exits with status 2


def _load_launchable(args, *, local: bool = True):
    """The job file with ``--set`` overrides, checked as far as it can be before anything starts
    (the spec; the parallelism divides ``resources.workers``; for a job run here, the model name
    resolves on this machine); None after printing why."""
    from hpservice.spec import SpecError, check_local_model, check_world, load_job

    try:
        spec = load_job(args.job, args.set)
        check_world(spec, source=args.job)
        if local:
            check_local_model(spec, source=args.job)
    except SpecError as e:
        print(e, file=sys.stderr)
        return None
    return spec


def _load_for_generation(path: str):
    """A plain Llama with the weights of ``path``: our checkpoint (its recorded config) or a
    Hugging Face directory."""
    from pathlib import Path

    import torch

    from hpservice.checkpoint import CheckpointManager
    from hpservice.models.hf import llama_config_from_hf, load_hf_weights
    from hpservice.models.llama import Llama, LlamaConfig

    p = Path(path)
    if (p / "config.json").is_file():
        model = Llama(llama_config_from_hf(p))
        load_hf_weights(model, p)
        return model
    recorded = torch.load(p / "extra" / "rank-0.pt", weights_only=True).get("model") or {}
    if recorded.get("name") != "llama":
        raise ValueError(f"{p}: not a llama checkpoint with its config recorded")
    model = Llama(LlamaConfig(**recorded["config"]))
    CheckpointManager(p.parent).load(model, step=int(p.name.removeprefix("step-")))
    return model


def _generate(args) -> int:
    from hpservice.data import ByteTokenizer
    from hpservice.models.generate import generate

    try:
        model = _load_for_generation(args.checkpoint)
        if args.tokenizer:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(args.tokenizer)
            encode, decode = (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
            eos = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>") if tok.token_to_id(t) is not None), None)
        elif model.cfg.vocab_size == 256:
            byte = ByteTokenizer()
            encode, decode, eos = byte.encode, byte.decode, None
        else:
            print(f"hpservice generate: a {model.cfg.vocab_size}-token model needs --tokenizer", file=sys.stderr)
            return 2
        ids = generate(
            model, list(encode(args.prompt)), args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, seed=args.seed, eos_id=eos,
        )  # fmt: skip
    except (OSError, ValueError, RuntimeError) as e:
        print(f"hpservice generate: {e}", file=sys.stderr)
        return 1
    print(args.prompt + decode(ids))
    return 0


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


# -- service commands (talk to the REST control plane through hpservice.client) -------------------

_SERVICE_COMMANDS = ("submit", "list", "status", "watch", "logs", "cancel", "checkpoints", "artifacts", "delete")


def _add_service_commands(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None, help="service URL (default: HPSERVICE_URL, else http://127.0.0.1:8000)")
    common.add_argument("--token", default=None, help="bearer token (default: HPSERVICE_TOKEN)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables and progress bars")

    def add(name: str, help: str):
        return sub.add_parser(
            name,
            help=help,
            description=help,
            parents=[common],
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = add("submit", "validate a job file locally, then submit it to the service")
    p.add_argument("job")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    p.add_argument("--watch", action="store_true", help="follow the job to its end, like `watch`")
    p.add_argument(
        "--idempotency-key", default=None, metavar="KEY", help="a retry with the same key returns the first job"
    )
    p = add("list", "list jobs, newest first")
    p.add_argument("--state", default=None, help="only jobs in this state (e.g. RUNNING)")
    p.add_argument("--name", default=None, help="only jobs with this name")
    p.add_argument("--owner", default=None, help="only jobs of this owner (admin tokens)")
    p.add_argument("--limit", type=int, default=50, help="page size (default 50)")
    p.add_argument("--cursor", default=None, help="the next_cursor of a previous page")
    p = add("status", "show one job: state, progress, restarts, checkpoints, history")
    p.add_argument("id")
    p = add(
        "watch",
        "follow a job with a live progress bar until it ends (--json: one JSON event per line, "
        'then {"event": "job", "data": <final job>})',
    )
    p.add_argument("id")
    p = add("logs", "print a job's log lines")
    p.add_argument("id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--rank", type=int, default=None, help="only this rank's lines")
    p.add_argument("--tail", type=int, default=None, help="the last N lines (server default: 100)")
    p = add("cancel", "cancel a job gracefully (finish the step, checkpoint, stop)")
    p.add_argument("id")
    p = add("checkpoints", "list a job's committed checkpoints")
    p.add_argument("id")
    p = add("artifacts", "list a job's artifacts (profiler traces, memory snapshots), or download them")
    p.add_argument("id")
    p.add_argument("--download", action="append", default=[], metavar="NAME", help="download this artifact ('all': every one)")
    p.add_argument("-o", "--out", default=".", help="folder to download into (default: the current one)")
    p = add("delete", "delete an ended job and its stored metrics and events")
    p.add_argument("id")


def _exit_code(e) -> int:
    if e.code == "bad_url":
        return ExitCode.USAGE
    if e.status == 404:
        return ExitCode.NOT_FOUND
    if e.status in (401, 403):
        return ExitCode.AUTH
    if 400 <= e.status < 500:
        return ExitCode.USAGE
    return ExitCode.SERVER


def _run_service_command(args) -> int:
    from hpservice.client import ClientError

    handlers = {
        "submit": _cmd_submit,
        "list": _cmd_list,
        "status": _cmd_status,
        "watch": _cmd_watch,
        "logs": _cmd_logs,
        "cancel": _cmd_cancel,
        "checkpoints": _cmd_checkpoints,
        "artifacts": _cmd_artifacts,
        "delete": _cmd_delete,
    }
    try:
        return handlers[args.command](args)
    except ClientError as e:
        print(f"hpservice {args.command}: {e}", file=sys.stderr)
        return _exit_code(e)


def _client(args):
    from hpservice.client import Client

    return Client(args.url, args.token)


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _print_json(obj, *, compact: bool = False) -> None:
    print(json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj, indent=2), flush=True)


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, int | float) else "-"


def _text(value):
    from rich.text import Text

    return Text("-" if value is None else str(value))


def _cmd_submit(args) -> int:
    spec = _load_launchable(args, local=False)  # the server resolves model names of its own
    if spec is None:
        return ExitCode.USAGE
    with _client(args) as client:
        job = client.submit(spec.model_dump(mode="json", by_alias=True), idempotency_key=args.idempotency_key)
        if args.json:
            _print_json(job, compact=args.watch)
        else:
            print(f"submitted job {job['id']} ({job['state']})", flush=True)
        if not args.watch:
            return ExitCode.OK
        return _watch(client, job["id"], args.json)


def _cmd_watch(args) -> int:
    with _client(args) as client:
        return _watch(client, args.id, args.json)


def _cmd_list(args) -> int:
    from rich.table import Table

    with _client(args) as client:
        page = client.list(state=args.state, name=args.name, owner=args.owner, limit=args.limit, cursor=args.cursor)
    if args.json:
        _print_json(page)
        return ExitCode.OK
    items = page.get("items", [])
    console = _console()
    if not items:
        console.print("no jobs")
    else:
        table = Table(box=None, pad_edge=False)
        table.add_column("ID", no_wrap=True, min_width=max(len(str(j.get("id"))) for j in items))
        for name in ("NAME", "OWNER", "STATE", "STEP", "RESTARTS", "CREATED"):
            table.add_column(name, justify="right" if name in ("STEP", "RESTARTS") else "left")
        for j in items:
            table.add_row(
                _text(j.get("id")),
                _text(j.get("name")),
                _text(j.get("owner")),
                _text(j.get("state")),
                _text(f"{j.get('step', 0)}/{j.get('total_steps', '?')}"),
                _text(j.get("restarts", 0)),
                _text(_when(j.get("created_at"))),
            )
        console.print(table)
    if page.get("next_cursor"):
        print(f"more jobs: --cursor {page['next_cursor']}", file=sys.stderr)
    return ExitCode.OK


def _cmd_status(args) -> int:
    from rich.table import Table

    with _client(args) as client:
        job = client.get(args.id)
    if args.json:
        _print_json(job)
        return ExitCode.OK
    console = _console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("id", _text(job.get("id")))
    grid.add_row("name", _text(job.get("name")))
    grid.add_row("owner", _text(job.get("owner")))
    state = job.get("state")
    grid.add_row("state", _text(f"{state}: {job['message']}" if job.get("message") else state))
    grid.add_row("step", _text(f"{job.get('step', 0)}/{job.get('total_steps', '?')}"))
    restarts = job.get("restarts", 0)
    reasons = job.get("restart_reasons") or []
    grid.add_row("restarts", _text(f"{restarts} ({'; '.join(reasons)})" if reasons else restarts))
    ckpts = job.get("checkpoints") or []
    latest = f" (latest: step {ckpts[-1].get('step')} at {ckpts[-1].get('path')})" if ckpts else ""
    grid.add_row("checkpoints", _text(f"{len(ckpts)}{latest}"))
    grid.add_row("created", _text(_when(job.get("created_at"))))
    grid.add_row("updated", _text(_when(job.get("updated_at"))))
    if job.get("ray_dashboard_url"):
        grid.add_row("dashboard", _text(job["ray_dashboard_url"]))
    console.print(grid)
    history = job.get("history") or []
    if history:
        console.print("[bold]history[/]")
        hist = Table.grid(padding=(0, 2))
        for _ in range(3):
            hist.add_column()
        for h in history:
            hist.add_row(_text(_when(h.get("time"))), _text(h.get("state")), _text(h.get("message") or ""))
        console.print(hist)
    return ExitCode.OK


def _cmd_cancel(args) -> int:
    with _client(args) as client:
        job = client.cancel(args.id)
    if args.json:
        _print_json(job)
    else:
        print(f"cancel requested for job {job.get('id', args.id)} ({job.get('state')})")
    return ExitCode.OK


def _cmd_delete(args) -> int:
    with _client(args) as client:
        client.delete(args.id)
    if args.json:
        _print_json({"deleted": args.id})
    else:
        print(f"deleted job {args.id}")
    return ExitCode.OK


def _cmd_checkpoints(args) -> int:
    from rich.table import Table

    with _client(args) as client:
        result = client.checkpoints(args.id)
    if args.json:
        _print_json(result)
        return ExitCode.OK
    ckpts = result.get("checkpoints", [])
    console = _console()
    if not ckpts:
        console.print(f"job {args.id} has no committed checkpoints")
        return ExitCode.OK
    table = Table(box=None, pad_edge=False)
    table.add_column("STEP", justify="right")
    table.add_column("TIME", no_wrap=True)
    table.add_column("PATH", overflow="fold")
    table.add_column("METRICS")
    for c in ckpts:
        metrics = c.get("metrics") or {}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        table.add_row(_text(c.get("step")), _text(_when(c.get("time"))), _text(c.get("path")), _text(shown))
    console.print(table)
    return ExitCode.OK


# -- following a job: the event stream, or polling when it is unavailable -------------------------


def _follow(client, job_id: str, on_event, *, start_step: int = 0, log_poll=None) -> str:
    """Feed ``on_event`` the job's events until a terminal state; returns that state.

    Uses the SSE stream; if it fails (other than on auth), polls ``metrics`` + ``get`` (and
    ``log_poll()``, which returns new log-event dicts) every ``_POLL_INTERVAL_S`` instead.
    """
    from hpservice.client import ClientError

    step = start_step
    try:
        for ev in client.events(job_id):
            if ev["event"] == "metrics" and isinstance(ev["data"].get("step"), int):
                step = max(step, ev["data"]["step"])
            on_event(ev)
            state = ev["data"].get("state") if ev["event"] == "state" else None
            if state in TERMINAL_STATES:
                return state
    except ClientError as e:
        if e.status in (401, 403):
            raise
        print(
            f"hpservice: event stream unavailable ({e.message}); polling every {_POLL_INTERVAL_S:g}s", file=sys.stderr
        )
    seen = None
    while True:
        result = client.metrics(job_id, since_step=step)
        for rec in result.get("records", []):
            on_event({"id": None, "event": "metrics", "data": rec})
        step = max(step, result.get("next_since_step") or step)
        if log_poll is not None:
            for line in log_poll():
                on_event({"id": None, "event": "log", "data": line})
        job = client.get(job_id)
        now = (job.get("state"), job.get("message"), job.get("restarts"))
        if now != seen:
            seen = now
            data = {"state": now[0], "message": now[1], "restarts": now[2], "time": job.get("updated_at")}
            on_event({"id": None, "event": "state", "data": data})
        if job.get("state") in TERMINAL_STATES:
            return job["state"]
        time.sleep(_POLL_INTERVAL_S)


def _watch(client, job_id: str, as_json: bool) -> int:
    """Follow ``job_id`` to its end (progress bar, or JSON lines); the exit code of its final state."""
    job = client.get(job_id)
    if job["state"] in TERMINAL_STATES:
        if as_json:
            _print_json({"id": None, "event": "job", "data": job}, compact=True)
        else:
            print_summary(_console(), job, client.metrics(job_id).get("records", []))
        return EXIT_FOR_STATE[job["state"]]
    try:
        if as_json:

            def on_event(ev):
                _print_json(ev, compact=True)

            state = _follow(client, job_id, on_event)
            records = []
        else:
            state, records = _watch_progress(client, job, _console())
    except KeyboardInterrupt:
        print(f"\nstopped watching job {job_id}; it goes on (`hpservice cancel {job_id}` stops it)", file=sys.stderr)
        return ExitCode.CANCELLED
    final = client.get(job_id)
    if final.get("state") not in TERMINAL_STATES:
        final["state"] = state
    if as_json:
        _print_json({"id": None, "event": "job", "data": final}, compact=True)
    else:
        print_summary(_console(), final, records)
    return EXIT_FOR_STATE[final["state"]]


def _watch_progress(client, job: dict, console):
    from rich.text import Text

    from hpservice._progress import job_progress

    records: dict[int, dict] = {}  # by step: a restart's replayed steps replace the earlier ones
    with job_progress(console) as progress:
        task = progress.add_task(
            "watch",
            total=job.get("total_steps") or None,
            completed=job.get("step", 0),
            state=job["state"],
            loss="-",
            tps="-",
            restarts=job.get("restarts", 0),
        )

        def on_event(ev):
            data, kind = ev["data"], ev["event"]
            if kind == "metrics":
                if isinstance(data.get("step"), int):
                    records[data["step"]] = data
                loss, tps = data.get("loss"), data.get("tokens_per_s")
                progress.update(
                    task,
                    completed=data.get("step", 0),
                    loss=f"{loss:.4f}" if isinstance(loss, int | float) else "-",
                    tps=f"{tps:,.0f}" if isinstance(tps, int | float) else "-",
                )
            elif kind == "state":
                progress.update(task, state=data.get("state", "?"), restarts=data.get("restarts", 0))
                if data.get("state") == JobState.RESTARTING and data.get("message"):
                    progress.console.print(Text(f"restarting: {data['message']}"))
            elif kind == "checkpoint":
                progress.console.print(Text(f"checkpoint at step {data.get('step')}: {data.get('path')}"))

        state = _follow(client, job["id"], on_event, start_step=job.get("step", 0))
    return state, [records[k] for k in sorted(records)]


# -- logs ------------------------------------------------------------------------------------------


def _log_text(line: dict) -> str:
    step = line.get("step")
    return f"[rank {line.get('rank', '?')} step {'-' if step is None else step}] {line.get('line', '')}"


def _cmd_logs(args) -> int:
    """Print the job's lines; with ``-f`` follow it, printing each line once: lines carry their
    event sequence number (``seq``, the SSE id), and only lines after the last printed one are
    printed, whether they come from the event stream or from polling ``?since=``."""
    with _client(args) as client:
        page = client.logs(args.id, rank=args.rank, tail=args.tail)
        for line in page.get("lines", []):
            print(_json_or_text(line, args.json), flush=True)
        if not args.follow:
            _note_artifacts(client, args.id)
            return ExitCode.OK
        cursor = polled_to = page.get("next_since", 0)

        def log_poll():  # only when the stream is unavailable; on_event prints what it returns
            nonlocal polled_to
            got = client.logs(args.id, rank=args.rank, since=max(cursor, polled_to))
            polled_to = got.get("next_since", polled_to)
            return got.get("lines", [])

        def on_event(ev):
            nonlocal cursor
            if ev["event"] != "log":
                return
            line = ev["data"]
            seq = ev["id"] if ev["id"] is not None else line.get("seq")
            if seq is not None and seq <= cursor:
                return  # the stream replays the history first: printed already
            cursor = max(cursor, seq or 0)
            if args.rank is None or line.get("rank") == args.rank:
                print(_json_or_text(line, args.json), flush=True)

        try:
            _follow(client, args.id, on_event, log_poll=log_poll)
        except KeyboardInterrupt:
            return ExitCode.CANCELLED
    return ExitCode.OK


def _note_artifacts(client, job_id: str) -> None:
    """After the log lines, on stderr (stdout stays the log): the run's artifacts, if any."""
    from hpservice.client import ClientError

    try:
        found = client.artifacts(job_id).get("artifacts", [])
    except ClientError:  # a server without artifacts: the log lines are what was asked for
        return
    if found:
        names = ", ".join(a["name"] for a in found)
        print(f"artifacts: {names} (hpservice artifacts {job_id} --download NAME)", file=sys.stderr)


# -- artifacts -------------------------------------------------------------------------------------


def _cmd_artifacts(args) -> int:
    with _client(args) as client:
        found = client.artifacts(args.id).get("artifacts", [])
        if not args.download:
            if args.json:
                print(json.dumps(found))
            for a in [] if args.json else found:
                print(f"{a['name']}  {a['size']:,} bytes")
            return ExitCode.OK
        names = [a["name"] for a in found] if "all" in args.download else args.download
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for name in names:
            print(client.download_artifact(args.id, name, out))
    return ExitCode.OK


def _json_or_text(line: dict, as_json: bool) -> str:
    return json.dumps(line, separators=(",", ":")) if as_json else _log_text(line)


if __name__ == "__main__":
    sys.exit(main())
