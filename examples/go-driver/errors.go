package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The stable reasons of docs/src/reference/protocol.md ("Reasons") that this driver produces. Callers decide
// on (code, reason), never on the message.
const (
	reasonFieldRequired          = "FIELD_REQUIRED"
	reasonFieldInvalid           = "FIELD_INVALID"
	reasonInvalidProviderSpec    = "INVALID_PROVIDER_SPEC"
	reasonMachineSpecConflict    = "MACHINE_SPEC_CONFLICT"
	reasonMachineNotFound        = "MACHINE_NOT_FOUND"
	reasonOperationPending       = "OPERATION_PENDING"
	reasonOperationTokenInvalid  = "OPERATION_TOKEN_INVALID"
	reasonOperationNotFound      = "OPERATION_NOT_FOUND"
	reasonOperationCancelled     = "OPERATION_CANCELLED"
	reasonCapabilityNotSupported = "CAPABILITY_NOT_SUPPORTED"
	reasonDeadlineExceeded       = "DEADLINE_EXCEEDED"
	reasonInternal               = "INTERNAL"
)

// driverError is an error the driver decided on: a gRPC code, the protocol's stable reason, and
// the invalid fields. It becomes a google.rpc.Status with ErrorInfo, RequestInfo and BadRequest
// only at the edge (toStatus), because only there are the domain and the request ID known.
type driverError struct {
	code       codes.Code
	reason     string
	message    string
	violations []*errdetails.BadRequest_FieldViolation
	retryAfter time.Duration // > 0 adds RetryInfo
}

func (e *driverError) Error() string { return e.message }

func newError(code codes.Code, reason, format string, args ...any) *driverError {
	return &driverError{code: code, reason: reason, message: fmt.Sprintf(format, args...)}
}

// withViolation names an invalid request field (BadRequest).
func (e *driverError) withViolation(field, description string) *driverError {
	e.violations = append(e.violations, &errdetails.BadRequest_FieldViolation{Field: field, Description: description})
	return e
}

func errUnadvertised(method string) *driverError {
	return newError(codes.Unimplemented, reasonCapabilityNotSupported,
		"%s is not supported: this driver does not advertise its capability", method)
}

// statusProto encodes the error with the protocol's details. ErrorInfo and RequestInfo are
// always present; BadRequest when fields are named; RetryInfo when the caller should wait.
func (e *driverError) statusProto(domain, requestID string) *spb.Status {
	details := []proto.Message{
		&errdetails.ErrorInfo{Reason: e.reason, Domain: domain},
		&errdetails.RequestInfo{RequestId: requestID},
	}
	if len(e.violations) > 0 {
		details = append(details, &errdetails.BadRequest{FieldViolations: e.violations})
	}
	if e.retryAfter > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(e.retryAfter)})
	}
	st := &spb.Status{Code: int32(e.code), Message: e.message}
	for _, d := range details {
		// Marshalling these small, well-formed messages cannot fail; skip one rather than panic.
		if a, err := anypb.New(d); err == nil {
			st.Details = append(st.Details, a)
		}
	}
	return st
}

// invalidRequest collects every violation of a request; the first one decides the reason
// (docs/src/reference/protocol.md: "Request validation collects every violation; the first one decides").
type invalidRequest struct {
	reason     string
	violations []*errdetails.BadRequest_FieldViolation
}

func (v *invalidRequest) add(reason, field, description string) {
	if v.reason == "" {
		v.reason = reason
	}
	v.violations = append(v.violations, &errdetails.BadRequest_FieldViolation{Field: field, Description: description})
}

// err is nil when nothing was wrong.
func (v *invalidRequest) err() error {
	if len(v.violations) == 0 {
		return nil
	}
	parts := make([]string, len(v.violations))
	for i, fv := range v.violations {
		parts[i] = fv.Field + ": " + fv.Description
	}
	e := newError(codes.InvalidArgument, v.reason, "invalid request: %s", strings.Join(parts, "; "))
	e.violations = v.violations
	return e
}

// ------------------------------------------------------------------------------- request IDs

const requestIDHeader = "x-request-id"

type requestIDKey struct{}

// requestIDFrom is the call's request ID (set by the interceptors).
func requestIDFrom(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}

// acceptRequestID takes the caller's x-request-id when it is 1–128 printable ASCII characters
// without spaces (the protocol's rule), and makes a UUID v4 otherwise.
func acceptRequestID(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	if ids := md.Get(requestIDHeader); len(ids) > 0 && validRequestID(ids[0]) {
		return ids[0]
	}
	return newUUID()
}

func validRequestID(id string) bool {
	if len(id) == 0 || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] <= ' ' || id[i] > '~' {
			return false
		}
	}
	return true
}

func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+).
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// ------------------------------------------------------------------------------ interceptors

const protocolPrefix = "/machinedriver.v1."

// unaryInterceptor gives every call a request ID (echoed in the response headers and carried by
// every log line and error of the call), turns handler errors into the protocol's rich status,
// and keeps a panic in a handler from taking the sidecar down.
func unaryInterceptor(domain string, log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		id := acceptRequestID(ctx)
		_ = grpc.SetHeader(ctx, metadata.Pairs(requestIDHeader, id))
		ctx = context.WithValue(ctx, requestIDKey{}, id)
		start := time.Now()
		defer func() {
			if p := recover(); p != nil {
				log.Error("handler panicked", "method", info.FullMethod, "request.id", id, "panic", fmt.Sprint(p),
					"stack", string(debug.Stack()))
				resp, err = nil, newError(codes.Internal, reasonInternal, "internal error in the driver")
			}
			if err != nil && strings.HasPrefix(info.FullMethod, protocolPrefix) {
				err = toStatus(err, domain, id)
			}
			log.Info("rpc", "method", info.FullMethod, "request.id", id, "code", status.Code(err).String(),
				"duration", time.Since(start).Round(time.Microsecond))
		}()
		return handler(ctx, req)
	}
}

// streamInterceptor echoes the request ID on streaming calls too (health Watch, reflection).
func streamInterceptor(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	_ = ss.SetHeader(metadata.Pairs(requestIDHeader, acceptRequestID(ss.Context())))
	return handler(srv, ss)
}

// toStatus turns a handler's error into the protocol's status. A driverError keeps its code
// and reason; the caller's deadline passing is DEADLINE_EXCEEDED with reason DEADLINE_EXCEEDED
// (what SDK drivers answer too); a caller that cancelled gets a plain CANCELLED (it no longer
// listens). Anything else leaving a protocol handler is a bug, reported as INTERNAL.
func toStatus(err error, domain, requestID string) error {
	var de *driverError
	switch {
	case errors.As(err, &de):
	case errors.Is(err, context.DeadlineExceeded):
		de = newError(codes.DeadlineExceeded, reasonDeadlineExceeded, "the call's deadline passed")
	case errors.Is(err, context.Canceled):
		return status.FromContextError(err).Err()
	default:
		de = newError(codes.Internal, reasonInternal, "internal error in the driver: %v", err)
	}
	return status.FromProto(de.statusProto(domain, requestID)).Err()
}
