"""python -m pagedattn [flags] info|health|validate|list|smoke: the basics of pagedattn-cli.

Messages print as JSON. Exit codes: 0 success (SERVING, valid, PASS), 1 an RPC error or a
negative answer (NOT_SERVING, invalid config, FAIL), 2 bad usage."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from google.protobuf import json_format

from . import errors
from ._common import TLS
from .client import Client
from .smoke import run_smoke
from .tensors import dtype_name
from .types import CacheConfig, LayerAttention
from .v1 import attention_pb2 as pb

COMMANDS = {
    "info": "server version, backend, device and capability table",
    "health": "grpc.health.v1 check: prints SERVING / NOT_SERVING",
    "validate": "dry-run CreateCache with the config flags: every violation and the size",
    "list": "every cache with its stats",
    "smoke": "random mixed prefill/decode batch through Forward, compared with a float64 "
    "reference; prints PASS/FAIL",
}


def to_json(message: Any) -> str:
    try:  # protobuf >= 5.26
        return json_format.MessageToJson(message, always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf 4.x
        return json_format.MessageToJson(message, including_default_value_fields=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedattn",
        description="pagedattn Python client: "
        + "; ".join(f"{k}: {v}" for k, v in COMMANDS.items()),
    )
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("--target", default="localhost:50051",
                   help="server address: host:port, [ipv6]:port or unix:/path/to.sock "
                   "(default %(default)s)")
    p.add_argument("--timeout_s", type=float, default=60,
                   help="deadline of each RPC, seconds (default %(default)g)")
    p.add_argument("--token", default=os.environ.get("PAGEDATTN_TOKEN", ""),
                   help="bearer token (default: $PAGEDATTN_TOKEN)")
    p.add_argument("--tls", action="store_true", help="TLS with the system roots")
    p.add_argument("--tls_ca", default="", help="PEM file of CA roots: connect with TLS")
    p.add_argument("--tls_cert", default="", help="client certificate PEM (mTLS)")
    p.add_argument("--tls_key", default="", help="client private key PEM (mTLS)")
    p.add_argument("--tls_server_name", default="", help="name to expect in the server certificate")
    g = p.add_argument_group("cache config (validate; smoke takes head_dim, page_size, heads, "
                             "kv_dtype and its scaling, device, and layers: 1 entry for both of "
                             "its layers or 2)")
    g.add_argument("--num_layers", type=int, default=32, help="layers (default %(default)s)")
    g.add_argument("--num_q_heads", type=int, default=None,
                   help="query heads (default 32; smoke: 8)")
    g.add_argument("--num_kv_heads", type=int, default=None, help="KV heads (default 8; smoke: 2)")
    g.add_argument("--head_dim", type=int, default=128,
                   help="elements per head, one of the server's (info); default %(default)s")
    g.add_argument("--page_size", type=int, default=16,
                   help="tokens per page, 1..1024 (default %(default)s)")
    g.add_argument("--kv_dtype", default="BFLOAT16",
                   help="FLOAT16, BFLOAT16, FLOAT32 (CPU) or FLOAT8_E4M3, any case "
                   "(default %(default)s)")
    g.add_argument("--kv_scaling", default=None,
                   help="FLOAT8_E4M3 only: PER_TOKEN (the default: a scale per row, computed at "
                   "append) or STATIC (with --kv_scales)")
    g.add_argument("--kv_scales", default="",
                   help="--kv_scaling=STATIC: K's and V's scale, comma-separated, for every layer "
                   "(2 values) or per layer (2 x num_layers)")
    g.add_argument("--layers", default="",
                   help="the layers' attention variants as JSON, one entry for every layer or one "
                   "per layer, e.g. '[{\"sliding_window\": 4096, \"logit_softcap\": 50}, "
                   "{\"logit_softcap\": 50}]' (LayerAttention's fields)")
    g.add_argument("--num_pages", type=int, default=0,
                   help="pages in the pool (default 0: --max_bytes, else 90%% of the free memory)")
    g.add_argument("--max_bytes", type=int, default=0,
                   help="byte budget of the pool, whole pages (default 0: unset)")
    g.add_argument("--device", type=int, default=0,
                   help="device index (CUDA backend; default %(default)s)")
    g.add_argument("--q_dtype", default="FLOAT32",
                   help="smoke: dtype of q on the wire (default %(default)s)")
    g.add_argument("--seed", type=int, default=1, help="smoke: random seed (default %(default)s)")
    return p


def _scales(text: str) -> tuple[float, ...]:
    """--kv_scales' numbers; a word that is none is a usage error (ValueError)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--kv_scales must be numbers, comma-separated (got {text!r})") from None


def _layers(text: str) -> tuple[LayerAttention, ...]:
    """--layers' JSON array of LayerAttention fields; anything else is a usage error."""
    if not text:
        return ()
    try:
        entries = json.loads(text)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("not an array of objects")
        return tuple(LayerAttention(**e) for e in entries)
    except (ValueError, TypeError) as e:
        raise ValueError("--layers must be a JSON array of LayerAttention objects, e.g. "
                         f"'[{{\"sliding_window\": 4096}}, {{}}]' ({e})") from None


def _check_names(a: argparse.Namespace) -> None:
    """The flags that name a dtype or a scaling, each checked by its flag's name (ValueError)."""
    for flag, valid in (("kv_dtype", ("float32", "float16", "bfloat16", "float8_e4m3")),
                        ("q_dtype", ("float32", "float16", "bfloat16"))):
        text = getattr(a, flag)
        try:
            ok = dtype_name(text) in valid
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise ValueError(f"--{flag} must be {', '.join(valid[:-1])} or {valid[-1]} "
                             f"(got {text!r})")
    if a.kv_scaling is not None and a.kv_scaling.upper() not in ("PER_TOKEN", "STATIC"):
        raise ValueError(f"--kv_scaling must be PER_TOKEN or STATIC (got {a.kv_scaling!r})")


def _tls(a: argparse.Namespace) -> Any:
    if a.tls_key and not a.tls_cert:
        raise ValueError("--tls_key needs --tls_cert (a client certificate and its key)")
    if a.tls_server_name and not (a.tls or a.tls_ca or a.tls_cert):
        raise ValueError("--tls_server_name applies to TLS: add --tls or --tls_ca")
    for flag, path in (("--tls_ca", a.tls_ca), ("--tls_cert", a.tls_cert), ("--tls_key", a.tls_key)):
        if path and not os.access(path, os.R_OK):
            why = "no such file" if not os.path.exists(path) else "not readable"
            raise ValueError(f"{flag} {path}: cannot read the file ({why})")
    if a.tls_ca or a.tls_cert:
        return TLS(ca=a.tls_ca or None, cert=a.tls_cert or None, key=a.tls_key or None,
                   server_name=a.tls_server_name or None)
    return TLS(server_name=a.tls_server_name or None) if a.tls else False


def run(a: argparse.Namespace) -> int:
    if a.command in ("validate", "smoke"):
        _check_names(a)
    with Client(a.target, a.token or None, tls=_tls(a), timeout=a.timeout_s) as c:
        if a.command == "info":
            print(to_json(c.server_info()))
        elif a.command == "health":
            serving = c.health()
            print("SERVING" if serving else "NOT_SERVING")
            return 0 if serving else 1
        elif a.command == "list":
            print(to_json(pb.ListCachesResponse(caches=c.list_caches())))
        elif a.command == "validate":
            config = CacheConfig(
                a.num_layers,
                32 if a.num_q_heads is None else a.num_q_heads,
                8 if a.num_kv_heads is None else a.num_kv_heads,
                a.head_dim,
                a.page_size,
                a.kv_dtype,
                num_pages=a.num_pages or None,
                max_bytes=a.max_bytes or None,
                device=a.device,
                kv_scaling=a.kv_scaling,
                kv_scales=_scales(a.kv_scales),
                layers=_layers(a.layers),
            )
            r = c.validate(config)
            print(to_json(r))
            return 0 if r.valid else 1
        elif a.command == "smoke":
            # The smoke makes its own cache: a layer count or capacity for it is a mistake to
            # report, not a value to drop.
            defaults = parser()
            for flag in ("num_layers", "num_pages", "max_bytes"):
                if getattr(a, flag) != defaults.get_default(flag):
                    raise ValueError(f"smoke makes its own cache (2 layers, the pages its steps "
                                     f"need): --{flag} is validate's")
            info = c.server_info()
            r = run_smoke(
                c,
                head_dim=a.head_dim,
                page_size=a.page_size,
                num_q_heads=8 if a.num_q_heads is None else a.num_q_heads,
                num_kv_heads=2 if a.num_kv_heads is None else a.num_kv_heads,
                kv_dtype=a.kv_dtype,
                q_dtype=a.q_dtype,
                seed=a.seed,
                kv_scaling=a.kv_scaling,
                kv_scales=_scales(a.kv_scales),
                device=a.device,
                layers=_layers(a.layers),
            )
            print(f"smoke against {a.target} (backend {info.backend}, {info.device_name}), "
                  f"cache {r.cache_id}:")
            print("\n".join(r.lines))
            print(f"max relative error {r.max_rel_error:.3g} (tolerance {r.tolerance:g}), "
                  f"max lse error {r.max_lse_error:.3g}, {r.spans_checked} spans checked")
            print("PASS" if r.passed else "FAIL")
            return 0 if r.passed else 1
    return 0


# The commands that read each command-specific flag (the connection's are every command's).
# smoke refuses --num_layers, --num_pages and --max_bytes itself, saying why.
_READ_BY = {
    **{name: ("validate", "smoke") for name in (
        "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "page_size", "kv_dtype",
        "kv_scaling", "kv_scales", "layers", "num_pages", "max_bytes", "device")},
    "q_dtype": ("smoke",), "seed": ("smoke",),
}


def _check_unread(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """A flag the command does not read is a usage error (ValueError), each one named."""
    unread = [f"--{name} is for {', '.join(commands)}, not {a.command}"
              for name, commands in _READ_BY.items()
              if a.command not in commands and getattr(a, name) != p.get_default(name)]
    if unread:
        raise ValueError("; ".join(unread))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    try:
        _check_unread(a, p)
        return run(a)
    except errors.PagedAttnError as e:
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, errors.CacheConfigError):
            for field, description in e.violations:
                print(f"  {field}: {description}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `python -m pagedattn ... | head`: the reader has gone
        # Python flushes stdout again at exit: into /dev/null, not into another error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process that SIGPIPE ended, by the shell's convention
    except OSError as e:  # a file named by a flag (--tls_ca, ...) that cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
