"""``shuffledp deploy``: keys for a Flower deployment and a real multi-process TLS deployment on one machine.

Six sub-commands:

``shuffledp deploy keys --out DIR --nodes N [--san NAME ...]``
    Every party's keys and certificates in one directory (:mod:`shuffledp.deploy.keys`; for tests), or with
    ``--party server|shuffler|device`` one party's, made on its own host (:mod:`shuffledp.deploy.party_keys`).

``shuffledp deploy sign-serverapp --keys DIR --csr FILE --out FILE``
    The shuffler operator issues the ServerApp's mTLS client certificate from the server's signing request.

``shuffledp deploy check --keys DIR``
    Whether a party's directory holds what it needs and no other party's secret; its public files' fingerprints.

``shuffledp deploy bundle --keys DIR --node I --out D --eps0 X --clip-l1 C``
    Copies the files one device needs (and nothing else) into ``D`` and writes its ``node-config.toml``
    (:mod:`shuffledp.deploy.bundle`); with ``--device D`` (and the three public files) it completes a device's own
    directory in place.

``shuffledp deploy time-work --node-config FILE``
    On the device: times its worst-case local work under its pinned limits (see ``--help``).

``shuffledp deploy local --nodes 3 --rounds 2 [--workdir DIR]``
    A TLS deployment with N SuperNodes on this machine (:mod:`shuffledp.deploy.local`); prints the per-round
    report and the timing breakdown (:mod:`shuffledp.deploy.timeline`).

Exit status: 0 on success, 2 for a wrong parameter (nothing was started or written), 1 for a failure, 130 for
Ctrl-C and 143 for SIGTERM/SIGHUP.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shuffledp.clients.settings import DEFAULT_MAX_LOCAL_EPOCHS, DEFAULT_MAX_MODEL_PARAMETERS, DEFAULT_MIN_BATCH_SIZE
from shuffledp.deploy import party_keys
from shuffledp.deploy.bundle import create_device_bundle
from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.flower import RUN_CONFIG_RULE, parse_run_config_args
from shuffledp.deploy.keys import DEFAULT_KEY_EPOCH, DeployKeys, create_deploy_keys
from shuffledp.deploy.local import LocalDeployment, run_local
from shuffledp.deploy.processes import Interrupted, platform_problem
from shuffledp.deploy.timeline import format_report
from shuffledp.deploy.watchdog import WatchdogError

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The parser of ``shuffledp deploy``.

    Returns:
        It, with one sub-parser per sub-command.
    """
    top = argparse.ArgumentParser(prog="shuffledp deploy", description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = top.add_subparsers(dest="action", required=True)
    k = sub.add_parser("keys", help="create the keys and certificates of a deployment (all, or one party's)")
    k.add_argument("--out", required=True, type=Path, help="new (empty) directory for the keys")
    k.add_argument("--party", choices=("all", "server", "shuffler", "device"), default="all",
                   help="whose keys: all (one directory with every party's secrets: tests only; the default), or "
                        "the server's, the shuffler's or one device's, made on that party's host "
                        "(deploy/README.md, 'Each party makes its own keys')")
    k.add_argument("--nodes", type=int, default=None, help="number of devices (SuperNodes/clients; --party all)")
    k.add_argument("--node", type=int, default=None, help="this device's index, its partition id (--party device)")
    k.add_argument("--san", action="append", default=[], metavar="NAME",
                   help="extra DNS name or IP address of the SuperLink/shuffler (repeatable)")
    k.add_argument("--key-epoch", type=int, default=None,
                   help=f"key epoch the shuffler expects (default {DEFAULT_KEY_EPOCH}; raise it when rotating keys)")
    k.add_argument("--k", type=int, default=None,
                   help="shuffler release threshold (distinct signers; required with --party shuffler)")

    sg = sub.add_parser("sign-serverapp", help="shuffler operator: issue the ServerApp's mTLS client certificate "
                                               "from the server's tls/serverapp.csr")
    sg.add_argument("--keys", required=True, type=Path, help="the shuffler operator's directory (--party shuffler)")
    sg.add_argument("--csr", required=True, type=Path, help="the server's certificate signing request")
    sg.add_argument("--out", required=True, type=Path, help="where to write the certificate (new file)")

    ck = sub.add_parser("check", help="check a party's key directory: what it needs, no other party's secrets, "
                                      "modes; print its public files' fingerprints")
    ck.add_argument("--keys", required=True, type=Path, help="a directory written by `shuffledp deploy keys`")

    b = sub.add_parser("bundle", help="write a device's bundle: the files it needs and its node config")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--keys", type=Path, help="directory written by `shuffledp deploy keys` (--party all)")
    src.add_argument("--device", type=Path,
                     help="on the device: complete its own directory (`deploy keys --party device`) in place")
    b.add_argument("--node", type=int, default=None, help="device index, its partition id (with --keys)")
    b.add_argument("--out", type=Path, default=None, help="new directory for the bundle (with --keys)")
    b.add_argument("--nodes", type=int, default=None, help="number of devices in the deployment (with --device)")
    b.add_argument("--superlink-ca", type=Path, default=None,
                   help="the server operator's superlink/ca.crt (with --device)")
    b.add_argument("--server-public-key", type=Path, default=None,
                   help="the server operator's public/server_hpke.pub (with --device)")
    b.add_argument("--shuffler-public-key", type=Path, default=None,
                   help="the shuffler operator's public/shuffler_hpke.pub (with --device)")
    b.add_argument("--eps0", type=float, default=None, help="eps0 the device pins (it refuses any other)")
    b.add_argument("--calibration", type=Path, default=None, metavar="FILE.json",
                   help="pin the eps0 of a plan: the output of `shuffledp account calibrate --json` (an upper-bound "
                        "family's); instead of --eps0")
    b.add_argument("--mechanism", default="laplace",
                   help="the local randomizer the device pins: laplace (default, L1 clip) | duchi (L2 clip)")
    b.add_argument("--clip-l1", type=float, default=None, help="L1 clip C the device pins (laplace)")
    b.add_argument("--clip-l2", type=float, default=None, help="L2 clip C the device pins (duchi)")
    b.add_argument("--reply-floor", type=float, default=0.0,
                   help="seconds before which the device sends no reply, so the reply time does not reveal how "
                        "long its local work took (set it above the slowest round's work); 0 = off")
    b.add_argument("--max-local-epochs", type=int, default=DEFAULT_MAX_LOCAL_EPOCHS,
                   help="the most local epochs the device does for one request (more is refused)")
    b.add_argument("--min-batch-size", type=int, default=DEFAULT_MIN_BATCH_SIZE,
                   help="the smallest minibatch the device trains with (smaller is refused)")
    b.add_argument("--max-model-parameters", type=int, default=DEFAULT_MAX_MODEL_PARAMETERS,
                   help="the largest model (total parameters) the device trains (larger is refused)")
    # the device's data settings (shuffledp.clients.settings.DATA_SETTINGS_DEFAULTS); the server's run config does not
    # choose them
    b.add_argument("--dataset", default=None, help="digits (bundled, default) | mnist (IDX files under --data-dir)")
    b.add_argument("--data-dir", default=None, help="folder on the device holding the dataset's files (mnist)")
    b.add_argument("--pca-components", type=int, default=None, help="PCA components (default 10; 0 = none)")
    b.add_argument("--partition", default=None, help="iid (default) | dirichlet: this device's share of the data")
    b.add_argument("--dirichlet-alpha", type=float, default=None, help="Dirichlet concentration (default 0.5)")
    b.add_argument("--seed", type=int, default=None,
                   help="seed of the data splits and the partition (default 0; must equal the run's)")
    b.add_argument("--prefix", default=None,
                   help="where the bundle will be on the device (default: --out; /device for the client image)")

    tw = sub.add_parser("time-work", help="on the device: time its worst-case local work under its pinned limits "
                                          "(to choose a reply-floor that covers it)")
    tw.add_argument("--node-config", required=True, type=Path, help="the device's node-config.toml (from `bundle`)")
    tw.add_argument("--repeat", type=int, default=3, help="timed repetitions per model shape (default 3)")

    loc = sub.add_parser("local", help="run a TLS deployment with N SuperNodes on this machine")
    loc.add_argument("--nodes", type=int, default=3, help="number of SuperNodes (simulated devices; default 3)")
    loc.add_argument("--rounds", type=int, default=2, help="number of rounds (run config num-server-rounds; default 2)")
    loc.add_argument("--workdir", type=Path, default=None,
                     help="directory for keys, logs, the database and outputs (default: a new temp directory)")
    loc.add_argument("--keys", type=Path, default=None, help="use keys from `shuffledp deploy keys` instead")
    loc.add_argument("--app", type=Path, default=None, help="the Flower app directory (default: this project)")
    loc.add_argument("--eps0", type=float, default=4.0, help="eps0 pinned on every SuperNode")
    loc.add_argument("--clip-l1", type=float, default=1.0, help="L1 clip C pinned on every SuperNode")
    loc.add_argument("--mechanism", default="laplace", help="the local randomizer every SuperNode pins: laplace "
                                                             "(default) | duchi (with --clip-l2)")
    loc.add_argument("--clip-l2", type=float, default=None, help="L2 clip C pinned on every SuperNode (duchi)")
    loc.add_argument("--min-reports", type=int, default=None, help="k: smallest batch shuffled (default: --nodes)")
    loc.add_argument("--reply-timeout", type=float, default=300.0, help="seconds the server waits for replies")
    loc.add_argument("--reply-floor", type=float, default=0.0,
                     help="seconds before which no SuperNode replies (see `bundle --reply-floor`); 0 = off")
    loc.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is stopped")
    loc.add_argument("--run-config", action="append", default=[], metavar="KEY=VALUE",
                     help=f"run-config overrides: {RUN_CONFIG_RULE}")
    loc.add_argument("--isolation", choices=("subprocess", "process"), default="subprocess",
                     help="process: run the ServerApp in a separate flower-superexec authenticated with the "
                          "SuperExec secret, as the compose deployment does")
    loc.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    return top



def _keys(args: argparse.Namespace) -> int:
    """``deploy keys``: every party's keys in one directory (``--party all``), or one party's."""
    allowed = {"all": {"nodes", "key_epoch", "k", "san"}, "server": {"san"},
               "shuffler": {"k", "key_epoch", "san"}, "device": {"node"}}[args.party]
    given = {"nodes": args.nodes is not None, "node": args.node is not None, "k": args.k is not None,
             "key_epoch": args.key_epoch is not None, "san": bool(args.san)}
    extra = sorted(f"--{name.replace('_', '-')}" for name, on in given.items() if on and name not in allowed)
    if extra:
        raise DeployUsageError(f"{', '.join(extra)} does not apply to --party {args.party}")
    needed = {"all": ("nodes",), "shuffler": ("k",), "device": ("node",)}.get(args.party, ())
    missing = [f"--{name}" for name in needed if not given[name]]
    if missing:
        raise DeployUsageError(f"--party {args.party} needs {', '.join(missing)}")
    key_epoch = DEFAULT_KEY_EPOCH if args.key_epoch is None else args.key_epoch
    if args.party == "all":
        paths = create_deploy_keys(args.out, args.nodes, sans=args.san, key_epoch=key_epoch, k=args.k)
        print(f"wrote deployment keys for {args.nodes} nodes to {paths.root}")
        print(f"  SuperLink CA (give to devices): {paths.superlink_ca_cert}")
        print(f"  register each device: flwr supernode register {paths.root}/supernodes/node-<i>.pub <connection>")
        print("  this directory holds every party's secrets (tests only); private keys are mode 0600; see "
              "deploy/README.md for which party keeps which file")
        return 0
    if args.party == "server":
        root = party_keys.create_server_keys(args.out, sans=args.san).root
        hand_over = ["tls/serverapp.csr to the shuffler operator (`deploy sign-serverapp`)",
                     "superlink/ca.crt and public/server_hpke.pub to every device"]
    elif args.party == "shuffler":
        root = party_keys.create_shuffler_keys(args.out, k=args.k, key_epoch=key_epoch, sans=args.san).root
        hand_over = ["public/shuffler_hpke.pub to every device",
                     "public/shuffler_signing.pub and tls/ca.crt to the server operator",
                     "then enrol each device's client.pub: `shuffledp keys enrol --enrolment "
                     f"{root}/enrolment.json --client-id client-<i> --public-key client.pub`"]
    else:
        root = party_keys.create_device_keys(args.out, args.node)
        hand_over = [f"client.pub to the shuffler operator (enrolled as client-{args.node})",
                     "supernode.pub to the server operator (`flwr supernode register`)",
                     "then complete it with `shuffledp deploy bundle --device` once the public keys have arrived"]
    print(f"wrote the {args.party}'s keys to {root} (private keys 0600, directory 0700); hand over (public):")
    for line in hand_over:
        print(f"  {line}")
    print(f"  `shuffledp deploy check --keys {root}` says what is still missing")
    return 0


def _check(root: Path) -> int:
    """``deploy check``: the problems of a key directory (exit 1 if any) and its public files' fingerprints."""
    problems = party_keys.check_party_directory(root)
    for line in problems:
        print(f"problem: {line}")
    for rel, digest in party_keys.public_fingerprints(root).items():
        print(f"sha256 {digest}  {rel}")
    print("ok: nothing is wrong with this directory" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def _calibrated_eps0(path: Path) -> float:
    """The eps0 of ``shuffledp account calibrate --json`` output; DeployUsageError unless it is a certified one (an
    upper-bound family's eps0 for a finite target)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DeployUsageError(f"--calibration {path}: not a readable JSON file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("quantity") != "eps0":
        raise DeployUsageError(f"--calibration {path}: not the output of `shuffledp account calibrate --json` (no "
                               "\"quantity\": \"eps0\")")
    if doc.get("kind") != "upper":
        raise DeployUsageError(f"--calibration {path}: calibrated with {doc.get('bound')!r}, a family of kind "
                               f"{doc.get('kind')!r}; a device pins only a certified eps0 (calibrate with an "
                               "upper-bound family such as clones)")
    value = doc.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise DeployUsageError(f"--calibration {path}: eps0 must be a finite number > 0, got {value!r}")
    return float(value)


def _bundle(args: argparse.Namespace) -> int:
    """``deploy bundle``: from a one-directory layout (``--keys``), or a device's own directory (``--device``)."""
    if (args.eps0 is None) == (args.calibration is None):
        raise DeployUsageError("bundle needs the eps0 the device pins: --eps0 E, or --calibration FILE.json (from "
                               "`shuffledp account calibrate --json`), not both")
    eps0 = args.eps0 if args.calibration is None else _calibrated_eps0(args.calibration)
    if args.mechanism == "laplace" and args.clip_l1 is None:
        raise DeployUsageError("bundle with --mechanism laplace needs --clip-l1 (the L1 clip the device pins)")
    limits_and_data: dict[str, Any] = {
        "mechanism": args.mechanism, "clip_l2": args.clip_l2,
        "reply_floor": args.reply_floor, "max_local_epochs": args.max_local_epochs,
        "min_batch_size": args.min_batch_size, "max_model_parameters": args.max_model_parameters,
        "data": {key: value for key, value in (
            ("dataset", args.dataset), ("data-dir", args.data_dir), ("pca-components", args.pca_components),
            ("partition", args.partition), ("dirichlet-alpha", args.dirichlet_alpha),
            ("seed", args.seed)) if value is not None}}
    device_flags = {"--nodes": args.nodes, "--superlink-ca": args.superlink_ca,
                    "--server-public-key": args.server_public_key, "--shuffler-public-key": args.shuffler_public_key}
    if args.keys is not None:
        wrong = [flag for flag, value in device_flags.items() if value is not None]
        if wrong or args.node is None or args.out is None:
            raise DeployUsageError("bundle --keys needs --node and --out" + (
                f", and takes no {', '.join(wrong)} (those complete a device's own directory, with --device)"
                if wrong else ""))
        dest = create_device_bundle(DeployKeys(args.keys), args.node, args.out, eps0=eps0,
                                    clip_l1=1.0 if args.clip_l1 is None else args.clip_l1, prefix=args.prefix,
                                    **limits_and_data)
        start = f"wrote the bundle of device {args.node} to {dest}; copy it to the device and start it with"
    else:
        missing = [flag for flag, value in device_flags.items() if value is None]
        if missing or args.node is not None or args.out is not None:
            raise DeployUsageError("bundle --device completes the device's directory in place: it needs "
                              f"{', '.join(device_flags)}" + (f" (missing: {', '.join(missing)})" if missing else "")
                              + " and takes no --node or --out (the node is in the directory's deploy.json)")
        dest = party_keys.complete_device_bundle(args.device, nodes=args.nodes, superlink_ca=args.superlink_ca,
                                      server_public_key=args.server_public_key,
                                      shuffler_public_key=args.shuffler_public_key, eps0=eps0,
                                      clip_l1=1.0 if args.clip_l1 is None else args.clip_l1, prefix=args.prefix,
                                      **limits_and_data)
        start = f"completed the device's bundle {dest}; start it with"
    print(start)
    print("  flower-supernode --superlink <superlink-host>:8000 --root-certificates <dir>/superlink-ca.crt "
          "--auth-supernode-private-key <dir>/supernode.key --node-config <dir>/node-config.toml")
    return 0


def _time_work(node_config_path: Path, repeat: int) -> int:
    """``deploy time-work``: print :func:`shuffledp.clients.worktime.time_worst_case` as JSON; warn on stderr if the
    pinned reply-floor does not cover the measured worst case. Exit 0 once measured (1 for a bad node config)."""
    import tomllib

    from shuffledp.clients.worktime import time_worst_case

    try:
        node = tomllib.loads(node_config_path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise DeployError(f"cannot read the node config {node_config_path}: {exc}") from None
    if "eps0" not in node:
        raise DeployError(f"{node_config_path} pins no eps0: it is not a device's node config (see `deploy bundle`)")
    print(f"shuffledp deploy: timing this device's worst-case request {repeat} time(s) under its pinned limits "
          f"(max-local-epochs {node.get('max-local-epochs', '?')}, min-batch-size {node.get('min-batch-size', '?')}, "
          f"max-model-parameters {node.get('max-model-parameters', '?')}); this can take minutes ...",
          file=sys.stderr, flush=True)
    try:
        result = time_worst_case(node, repeat=repeat)
    except ValueError as exc:  # ClientSetupError (keys, limits, data settings), a bad --repeat, unloadable data
        raise DeployError(str(exc)) from None
    print(json.dumps(result, indent=1))
    worst, floor = result["worst_s"], result["reply_floor_s"]
    if not result["covered"]:
        state = "off" if floor == 0 else f"{floor:g} s"
        print(f"shuffledp deploy: the reply-floor ({state}) does not cover the measured worst case ({worst:.2f} s): "
              f"set it well above that (e.g. {math.ceil(2 * worst)} s) with `bundle --reply-floor`, and below the "
              "server's reply-timeout", file=sys.stderr)
    else:
        print(f"the reply-floor ({floor:g} s) covers the measured worst case ({worst:.2f} s); this is a measurement, "
              "not a bound: keep a margin", file=sys.stderr)
    return 0


def main(argv: Sequence[str]) -> int:
    """``shuffledp deploy ...``; ``argv[0]`` is ``"deploy"``. Returns the exit code."""
    args_list = list(argv)[1:] if argv and argv[0] == "deploy" else list(argv)
    try:
        args = parser().parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.action == "keys":
            return _keys(args)
        if args.action == "sign-serverapp":
            cert = party_keys.sign_serverapp_request(args.keys, args.csr, args.out)
            print(f"signed the request with sha256 {hashlib.sha256(args.csr.read_bytes()).hexdigest()} (compare it "
                  "with the server's `deploy check` output over a second channel before trusting it)")
            print(f"wrote the ServerApp's client certificate {cert}; send it to the server operator with "
                  f"{args.keys / 'tls' / 'ca.crt'} (its tls/serverapp.crt and tls/ca.crt)")
            return 0
        if args.action == "check":
            return _check(args.keys)
        if args.action == "bundle":
            return _bundle(args)
        if args.action == "time-work":
            return _time_work(args.node_config, args.repeat)
        problem = platform_problem()
        if problem is not None:
            raise DeployUsageError(f"deploy local {problem}")
        cfg = LocalDeployment(nodes=args.nodes, rounds=args.rounds, workdir=args.workdir, keys_dir=args.keys,
                              app_dir=args.app, eps0=args.eps0, clip_l1=args.clip_l1,
                              mechanism=args.mechanism, clip_l2=args.clip_l2,
                              min_reports=args.min_reports, reply_timeout=args.reply_timeout,
                              reply_floor=args.reply_floor, timeout=args.timeout,
                              run_config=parse_run_config_args(args.run_config), isolation=args.isolation)
        result = run_local(cfg, out=sys.stderr if args.json else sys.stdout)  # keep --json output parseable
        if args.json:
            print(json.dumps({"status": result.status, "run-id": result.run_id, "report": result.report,
                              "timings": result.timings, "workdir": str(result.workdir)}, indent=1, default=str))
        else:
            print(format_report(result))
        return 0 if result.status == "finished:completed" and result.report is not None else 1
    except DeployUsageError as exc:
        print(f"shuffledp deploy: {exc}", file=sys.stderr)
        return 2
    except (DeployError, WatchdogError) as exc:
        print(f"shuffledp deploy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shuffledp deploy: interrupted; every process was stopped", file=sys.stderr)
        return 130
    except Interrupted as exc:
        print(f"shuffledp deploy: {exc}; every process was stopped", file=sys.stderr)
        return 143
