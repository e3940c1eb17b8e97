package main

import (
	"context"
	"encoding/base64"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

// driver holds what every service needs. The four protocol services are separate types
// because each generated Unimplemented*Server must be embedded on its own.
type driver struct {
	name    string // DNS-style; the ErrorInfo domain of every error
	version string
	schema  *structpb.Struct
	cloud   *cloud
	tokens  *tokenCodec
	log     *slog.Logger
	events  *eventHub // nil without --event-dir: EVENTS is not advertised
}

// The capabilities this driver always advertises (EVENTS too with --event-dir). Pools and in-place updates are not among them, so
// their RPCs answer UNIMPLEMENTED / CAPABILITY_NOT_SUPPORTED; without CANCEL_OPERATION,
// CancelOperation returns the operation unchanged.
var capabilities = []pb.Capability{pb.Capability_CAPABILITY_MACHINES, pb.Capability_CAPABILITY_VALIDATE_MACHINE_CLASS}

// operation turns the cloud's view of an operation into the protocol's message, sealing the
// token. Every operation, done or not, carries a token and a poll_after.
func (d *driver) operation(ctx context.Context, st opState) *pb.Operation {
	p := st.token
	op := &pb.Operation{
		Name:            p.Op,
		Kind:            p.Kind,
		Target:          p.Target,
		Done:            st.done,
		ProgressPercent: st.progress,
		PollAfter:       durationpb.New(time.Second),
		Token:           d.tokens.seal(p),
		StartTime:       timestamppb.New(time.UnixMilli(p.Start)),
	}
	if st.pollAfter > 0 {
		op.PollAfter = durationpb.New(st.pollAfter)
	}
	if !st.done {
		return op
	}
	op.EndTime = timestamppb.Now()
	if st.err != nil {
		// Its RequestInfo names the poll that reported the failure.
		op.Result = &pb.Operation_Error{Error: st.err.statusProto(d.name, requestIDFrom(ctx))}
	} else {
		op.Result = &pb.Operation_Response{Response: &pb.OperationResult{Machine: st.machine}}
	}
	return op
}

// ---------------------------------------------------------------------------------- Identity

type identityServer struct {
	pb.UnimplementedIdentityServer
	*driver
}

func (s identityServer) GetDriverInfo(context.Context, *pb.GetDriverInfoRequest) (*pb.GetDriverInfoResponse, error) {
	return &pb.GetDriverInfoResponse{Name: s.name, VendorVersion: s.version, ProtocolVersion: "v1", ProviderSpecSchema: s.schema}, nil
}

func (s identityServer) GetCapabilities(context.Context, *pb.GetCapabilitiesRequest) (*pb.GetCapabilitiesResponse, error) {
	caps := append([]pb.Capability(nil), capabilities...)
	if s.events != nil {
		caps = append(caps, pb.Capability_CAPABILITY_EVENTS)
	}
	return &pb.GetCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe: the in-memory cloud is ready as soon as the process is.
func (s identityServer) Probe(context.Context, *pb.ProbeRequest) (*pb.ProbeResponse, error) {
	return &pb.ProbeResponse{Ready: true, Message: "in-memory cloud ready"}, nil
}

// ---------------------------------------------------------------------------------- Machines

type machinesServer struct {
	pb.UnimplementedMachinesServer
	*driver
}

func (s machinesServer) CreateMachine(ctx context.Context, req *pb.CreateMachineRequest) (*pb.Operation, error) {
	var v invalidRequest
	checkName(&v, "name", req.GetName())
	checkSpec(&v, "provider_spec", req.GetProviderSpec())
	if err := v.err(); err != nil {
		return nil, err
	}
	st, fresh, err := s.cloud.startCreate(req.GetName(), specHash(req.GetProviderSpec()), req.GetLabels())
	if err != nil {
		return nil, err
	}
	if fresh {
		// Tests count these lines: one per machine the cloud really created.
		s.log.Info("creating machine", "machine", req.GetName(), "operation", st.token.Op, "request.id", requestIDFrom(ctx))
	}
	return s.operation(ctx, st), nil
}

func (s machinesServer) DeleteMachine(ctx context.Context, req *pb.DeleteMachineRequest) (*pb.Operation, error) {
	var v invalidRequest
	checkName(&v, "name", req.GetName())
	if err := v.err(); err != nil {
		return nil, err
	}
	st := s.cloud.startDelete(req.GetName())
	if !st.done {
		s.log.Info("deleting machine", "machine", req.GetName(), "operation", st.token.Op, "request.id", requestIDFrom(ctx))
	}
	return s.operation(ctx, st), nil
}

func (s machinesServer) GetMachineStatus(_ context.Context, req *pb.GetMachineStatusRequest) (*pb.Machine, error) {
	var v invalidRequest
	checkName(&v, "name", req.GetName())
	if err := v.err(); err != nil {
		return nil, err
	}
	m, ok := s.cloud.get(req.GetName())
	if !ok {
		return nil, newError(codes.NotFound, reasonMachineNotFound, "machine %s does not exist", req.GetName())
	}
	return m, nil
}

// ListMachines pages by name: the page token is the last name of the previous page, base64url
// encoded so that callers treat it as opaque.
func (s machinesServer) ListMachines(_ context.Context, req *pb.ListMachinesRequest) (*pb.ListMachinesResponse, error) {
	var v invalidRequest
	size := int(req.GetPageSize())
	switch {
	case size < 0:
		v.add(reasonFieldInvalid, "page_size", "must not be negative")
	case size == 0:
		size = 100
	case size > 1000:
		size = 1000
	}
	var after string
	if t := req.GetPageToken(); t != "" {
		b, err := base64.RawURLEncoding.DecodeString(t)
		if err != nil || nameProblem(string(b)) != "" {
			v.add(reasonFieldInvalid, "page_token", "not a page token this driver issued; start again from an empty token")
		}
		after = string(b)
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	machines, more := s.cloud.list(req.GetLabelSelector(), after, size)
	resp := &pb.ListMachinesResponse{Machines: machines}
	if more && len(machines) > 0 {
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString([]byte(machines[len(machines)-1].GetName()))
	}
	return resp, nil
}

func (s machinesServer) ValidateMachineClass(_ context.Context, req *pb.ValidateMachineClassRequest) (*pb.ValidateMachineClassResponse, error) {
	var v invalidRequest
	checkSpec(&v, "provider_spec", req.GetProviderSpec())
	if err := v.err(); err != nil {
		return nil, err
	}
	resp := &pb.ValidateMachineClassResponse{}
	if _, ok := req.GetProviderSpec().GetFields()["image"]; !ok {
		resp.Warnings = append(resp.Warnings, "image is not set; machines boot the default image")
	}
	return resp, nil
}

// CAPABILITY_IN_PLACE_UPDATE is not advertised: refuse before looking at the request. Every spec
// change replaces the machine, so there is no in-place disruption to state. A driver that
// advertises it answers, besides the paths, what its in-place changes do to the running machine:
// Disruption: pb.InPlaceDisruption_IN_PLACE_DISRUPTION_NONE (nothing restarts: tags), _DRAIN
// (workloads must move off) or _REBOOT (the VM restarts; also how an unset answer is read).
func (machinesServer) CanUpdateMachine(context.Context, *pb.CanUpdateMachineRequest) (*pb.CanUpdateMachineResponse, error) {
	return nil, errUnadvertised("CanUpdateMachine")
}

func (machinesServer) UpdateMachine(context.Context, *pb.UpdateMachineRequest) (*pb.Operation, error) {
	return nil, errUnadvertised("UpdateMachine")
}

// ------------------------------------------------------------------------------------- Pools

// poolsServer is served (reflection lists it, callers get a proper error) but CAPABILITY_POOLS
// is not advertised, so every RPC answers UNIMPLEMENTED with reason CAPABILITY_NOT_SUPPORTED.
type poolsServer struct {
	pb.UnimplementedPoolsServer
}

func (poolsServer) ApplyPool(context.Context, *pb.ApplyPoolRequest) (*pb.Operation, error) {
	return nil, errUnadvertised("ApplyPool")
}

func (poolsServer) GetPool(context.Context, *pb.GetPoolRequest) (*pb.Pool, error) {
	return nil, errUnadvertised("GetPool")
}

func (poolsServer) ListPoolInstances(context.Context, *pb.ListPoolInstancesRequest) (*pb.ListPoolInstancesResponse, error) {
	return nil, errUnadvertised("ListPoolInstances")
}

func (poolsServer) DeletePoolInstances(context.Context, *pb.DeletePoolInstancesRequest) (*pb.Operation, error) {
	return nil, errUnadvertised("DeletePoolInstances")
}

func (poolsServer) UpgradePoolInstances(context.Context, *pb.UpgradePoolInstancesRequest) (*pb.Operation, error) {
	return nil, errUnadvertised("UpgradePoolInstances")
}

func (poolsServer) DeletePool(context.Context, *pb.DeletePoolRequest) (*pb.Operation, error) {
	return nil, errUnadvertised("DeletePool")
}

// -------------------------------------------------------------------------------- Operations

type operationsServer struct {
	pb.UnimplementedOperationsServer
	*driver
}

func (s operationsServer) GetOperation(ctx context.Context, req *pb.GetOperationRequest) (*pb.Operation, error) {
	p, err := s.tokens.open(req.GetToken())
	if err != nil {
		return nil, err
	}
	return s.operation(ctx, s.cloud.poll(p, true)), nil
}

// WaitOperation polls at poll_after until the operation is done or the bound passes:
// min(timeout, call deadline − 100 ms, 60 s); timeout unset → 60 s, negative → one poll.
func (s operationsServer) WaitOperation(ctx context.Context, req *pb.WaitOperationRequest) (*pb.Operation, error) {
	p, err := s.tokens.open(req.GetToken())
	if err != nil {
		return nil, err
	}
	bound := time.Minute
	if t := req.GetTimeout(); t != nil {
		bound = min(max(t.AsDuration(), 0), bound)
	}
	if dl, ok := ctx.Deadline(); ok {
		bound = min(bound, max(time.Until(dl)-100*time.Millisecond, 0))
	}
	end := time.Now().Add(bound)
	for {
		st := s.cloud.poll(p, true)
		left := time.Until(end)
		if st.done || left <= 0 {
			return s.operation(ctx, st), nil
		}
		timer := time.NewTimer(min(max(st.pollAfter, 10*time.Millisecond), left))
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
}

// CancelOperation: CAPABILITY_CANCEL_OPERATION is not advertised, so the operation comes back
// unchanged (and this look does not count as a poll).
func (s operationsServer) CancelOperation(ctx context.Context, req *pb.CancelOperationRequest) (*pb.Operation, error) {
	p, err := s.tokens.open(req.GetToken())
	if err != nil {
		return nil, err
	}
	return s.operation(ctx, s.cloud.poll(p, false)), nil
}
