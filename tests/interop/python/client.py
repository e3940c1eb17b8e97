"""Interop client: Python grpcio (C-core) with default channel options.

Stubs come from proto/ through grpcio-tools at install time (tests/tools/install-interop.sh puts
them on PYTHONPATH); error details are decoded with grpcio-status and googleapis-common-protos.

Contract (shared by every client in tests/interop/):
  --target unix:///path.sock | --target host:port   where to connect
  --request-id ID            x-request-id of CreateMachine; the invalid request sends ID-invalid
  --create-json JSON         a valid CreateMachineRequest (protobuf JSON); without it no create
  --invalid-rpc RPC          CreateMachine (default) or ApplyPool, sent with an empty name
  --version                  prints the client stack's version
Checks health (SERVING), GetDriverInfo (a name), the create's echoed x-request-id, and the
invalid request's INVALID_ARGUMENT with ErrorInfo + RequestInfo + BadRequest (field "name").
Prints one JSON line on success; exits 1 with "interop check failed: ..." on any failed check.
"""

import argparse
import json
import sys

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from machinedriver.v1 import driver_pb2, driver_pb2_grpc

TIMEOUT_S = 15
CLIENT = "python-grpcio"


class CheckFailed(Exception):
    pass


# The call under way, named in the message of an unexpected RPC error.
step = "connect"


def check(ok, what):
    if not ok:
        raise CheckFailed(what)


def metadata_value(pairs, key):
    for k, v in pairs or ():
        if k == key:
            return v
    return None


def decode_details(err):
    """ErrorInfo, RequestInfo and BadRequest from an RpcError's grpc-status-details-bin."""
    status = rpc_status.from_call(err)
    check(status is not None, "the error has no grpc-status-details-bin trailer")
    found = {}
    for any_msg in status.details:
        for name, cls in (
            ("error_info", error_details_pb2.ErrorInfo),
            ("request_info", error_details_pb2.RequestInfo),
            ("bad_request", error_details_pb2.BadRequest),
        ):
            if any_msg.Is(cls.DESCRIPTOR):
                msg = cls()
                any_msg.Unpack(msg)
                found[name] = msg
    return status, found


def run(args):
    global step
    channel = grpc.insecure_channel(args.target)
    try:
        step = "health"
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        check(
            reply.status == health_pb2.HealthCheckResponse.SERVING,
            f"health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}, want SERVING",
        )

        step = "GetDriverInfo"
        identity = driver_pb2_grpc.IdentityStub(channel)
        info = identity.GetDriverInfo(driver_pb2.GetDriverInfoRequest(), timeout=TIMEOUT_S)
        check(info.name, "GetDriverInfo returned an empty name")

        machines = driver_pb2_grpc.MachinesStub(channel)
        created = None
        if args.create_json:
            step = "CreateMachine"
            req = json_format.Parse(args.create_json, driver_pb2.CreateMachineRequest())
            op, call = machines.CreateMachine.with_call(
                req, timeout=TIMEOUT_S, metadata=[("x-request-id", args.request_id)]
            )
            echoed = metadata_value(call.initial_metadata(), "x-request-id")
            check(
                echoed == args.request_id,
                f"CreateMachine: response x-request-id {echoed!r}, sent {args.request_id!r}",
            )
            check(op.token, "CreateMachine returned an operation without a token")
            created = {"operation": op.name, "echoed_request_id": echoed}

        invalid_id = args.request_id + "-invalid"
        step = f"{args.invalid_rpc} with an empty name"
        if args.invalid_rpc == "ApplyPool":
            rpc, req = driver_pb2_grpc.PoolsStub(channel).ApplyPool, driver_pb2.ApplyPoolRequest(name="")
        else:
            rpc, req = machines.CreateMachine, driver_pb2.CreateMachineRequest(name="")
        try:
            rpc(req, timeout=TIMEOUT_S, metadata=[("x-request-id", invalid_id)])
            raise CheckFailed(f"{args.invalid_rpc} with an empty name succeeded")
        except grpc.RpcError as err:
            check(
                err.code() == grpc.StatusCode.INVALID_ARGUMENT,
                f"{args.invalid_rpc} with an empty name: {err.code().name} ({err.details()}), want INVALID_ARGUMENT",
            )
            status, d = decode_details(err)
        for name in ("error_info", "request_info", "bad_request"):
            check(name in d, f"grpc-status-details-bin lacks {name}: {status}")
        check(d["error_info"].reason and d["error_info"].domain, f"ErrorInfo without reason/domain: {d['error_info']}")
        check(
            d["request_info"].request_id == invalid_id,
            f"RequestInfo.request_id {d['request_info'].request_id!r}, sent {invalid_id!r}",
        )
        fields = [v.field for v in d["bad_request"].field_violations]
        check("name" in fields, f"BadRequest names {fields}, want 'name' among them")
        return {
            "client": CLIENT,
            "version": grpc.__version__,
            "target": args.target,
            "health": "SERVING",
            "driver": info.name,
            "create": created,
            "invalid": {
                "code": "INVALID_ARGUMENT",
                "reason": d["error_info"].reason,
                "domain": d["error_info"].domain,
                "request_id": d["request_info"].request_id,
                "fields": fields,
                "message": status.message,
            },
        }
    finally:
        channel.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target")
    p.add_argument("--request-id", default="interop-python")
    p.add_argument("--create-json")
    p.add_argument("--invalid-rpc", choices=["CreateMachine", "ApplyPool"], default="CreateMachine")
    p.add_argument("--version", action="store_true")
    args = p.parse_args()
    if args.version:
        print(f"{CLIENT} {grpc.__version__}")
        return 0
    if not args.target:
        p.error("--target is required")
    try:
        summary = run(args)
    except CheckFailed as e:
        print(f"interop check failed ({CLIENT} {grpc.__version__}, {args.target}): {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(
            f"interop check failed ({CLIENT} {grpc.__version__}, {args.target}): {step}: "
            f"RPC error {e.code().name}: {e.details()}",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
