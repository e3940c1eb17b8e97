// Interop client: grpc-go, dialed the two ways Go programs dial a Unix socket, and over TCP.
//
//	--target unix:///path.sock   grpc.NewClient with a unix:/// target (grpc-go sends :authority "localhost")
//	--dial-path /path.sock       the kubelet / CSI pattern: grpc.Dial(path) with a custom unix dialer
//	                             (grpc-go sends the path, percent-encoded, as :authority)
//	--target host:port           grpc.NewClient over TCP
//
// The rest of the contract is shared by every client in tests/interop/:
//
//	--request-id ID     x-request-id of CreateMachine; the invalid request sends ID-invalid
//	--create-json JSON  a valid CreateMachineRequest (protobuf JSON); without it no create
//	--invalid-rpc RPC   CreateMachine (default) or ApplyPool, sent with an empty name
//	--version           prints the client stack's version
//
// Prints one JSON line on success; exits 1 with "interop check failed: ..." on any failed check.
// The machinedriver.v1 stubs are the Go driver's (examples/go-driver/gen, generated from proto/),
// reached through a replace directive in go.mod.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"slices"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

const (
	client  = "go-grpc"
	timeout = 15 * time.Second
)

type options struct {
	target, dialPath, requestID, createJSON, invalidRPC string
}

// check returns an error saying what failed unless ok.
func check(ok bool, format string, args ...any) error {
	if ok {
		return nil
	}
	return fmt.Errorf(format, args...)
}

// dial connects the way the options say; the returned string names the transport.
func dial(o options) (*grpc.ClientConn, string, error) {
	creds := grpc.WithTransportCredentials(insecure.NewCredentials())
	if o.dialPath != "" {
		// Exactly what the kubelet's plugin and device-plugin managers do.
		conn, err := grpc.Dial(o.dialPath, creds, //nolint:staticcheck // the pattern under test
			grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", addr)
			}))
		return conn, "dial-path " + o.dialPath, err
	}
	conn, err := grpc.NewClient(o.target, creds)
	return conn, o.target, err
}

type invalidSummary struct {
	Code      string   `json:"code"`
	Reason    string   `json:"reason"`
	Domain    string   `json:"domain"`
	RequestID string   `json:"request_id"`
	Fields    []string `json:"fields"`
	Message   string   `json:"message"`
}

type summary struct {
	Client  string            `json:"client"`
	Version string            `json:"version"`
	Target  string            `json:"target"`
	Health  string            `json:"health"`
	Driver  string            `json:"driver"`
	Create  map[string]string `json:"create"`
	Invalid invalidSummary    `json:"invalid"`
}

func withID(ctx context.Context, id string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "x-request-id", id)
}

func run(o options) (*summary, error) {
	conn, target, err := dial(o)
	if err != nil {
		return nil, fmt.Errorf("dial: %w", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	s := &summary{Client: client, Version: grpc.Version, Target: target}

	h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return nil, fmt.Errorf("health: %w", err)
	}
	if err := check(h.GetStatus() == healthpb.HealthCheckResponse_SERVING, "health: %s, want SERVING", h.GetStatus()); err != nil {
		return nil, err
	}
	s.Health = h.GetStatus().String()

	info, err := pb.NewIdentityClient(conn).GetDriverInfo(ctx, &pb.GetDriverInfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("GetDriverInfo: %w", err)
	}
	if err := check(info.GetName() != "", "GetDriverInfo returned an empty name"); err != nil {
		return nil, err
	}
	s.Driver = info.GetName()

	machines := pb.NewMachinesClient(conn)
	if o.createJSON != "" {
		req := &pb.CreateMachineRequest{}
		if err := protojson.Unmarshal([]byte(o.createJSON), req); err != nil {
			return nil, fmt.Errorf("--create-json: %w", err)
		}
		var header metadata.MD
		op, err := machines.CreateMachine(withID(ctx, o.requestID), req, grpc.Header(&header))
		if err != nil {
			return nil, fmt.Errorf("CreateMachine: %w", err)
		}
		echoed := header.Get("x-request-id")
		if err := check(len(echoed) == 1 && echoed[0] == o.requestID,
			"CreateMachine: response x-request-id %q, sent %q", echoed, o.requestID); err != nil {
			return nil, err
		}
		if err := check(len(op.GetToken()) > 0, "CreateMachine returned an operation without a token"); err != nil {
			return nil, err
		}
		s.Create = map[string]string{"operation": op.GetName(), "echoed_request_id": echoed[0]}
	}

	invalidID := o.requestID + "-invalid"
	if o.invalidRPC == "ApplyPool" {
		_, err = pb.NewPoolsClient(conn).ApplyPool(withID(ctx, invalidID), &pb.ApplyPoolRequest{})
	} else {
		_, err = machines.CreateMachine(withID(ctx, invalidID), &pb.CreateMachineRequest{})
	}
	if err := check(err != nil, "%s with an empty name succeeded", o.invalidRPC); err != nil {
		return nil, err
	}
	st := status.Convert(err)
	if err := check(st.Code() == codes.InvalidArgument,
		"%s with an empty name: %s (%s), want INVALID_ARGUMENT", o.invalidRPC, st.Code(), st.Message()); err != nil {
		return nil, err
	}
	var (
		errorInfo   *errdetails.ErrorInfo
		requestInfo *errdetails.RequestInfo
		badRequest  *errdetails.BadRequest
	)
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			errorInfo = d
		case *errdetails.RequestInfo:
			requestInfo = d
		case *errdetails.BadRequest:
			badRequest = d
		case error:
			return nil, fmt.Errorf("undecodable error detail: %w", d)
		}
	}
	if err := check(errorInfo != nil && requestInfo != nil && badRequest != nil,
		"grpc-status-details-bin lacks ErrorInfo, RequestInfo or BadRequest: %v", st.Proto()); err != nil {
		return nil, err
	}
	if err := check(errorInfo.GetReason() != "" && errorInfo.GetDomain() != "",
		"ErrorInfo without reason/domain: %v", errorInfo); err != nil {
		return nil, err
	}
	if err := check(requestInfo.GetRequestId() == invalidID,
		"RequestInfo.request_id %q, sent %q", requestInfo.GetRequestId(), invalidID); err != nil {
		return nil, err
	}
	var fields []string
	for _, v := range badRequest.GetFieldViolations() {
		fields = append(fields, v.GetField())
	}
	if err := check(slices.Contains(fields, "name"), "BadRequest names %q, want \"name\" among them", fields); err != nil {
		return nil, err
	}
	s.Invalid = invalidSummary{
		Code: "INVALID_ARGUMENT", Reason: errorInfo.GetReason(), Domain: errorInfo.GetDomain(),
		RequestID: requestInfo.GetRequestId(), Fields: fields, Message: st.Message(),
	}
	return s, nil
}

func main() {
	var o options
	version := flag.Bool("version", false, "print the client stack's version")
	flag.StringVar(&o.target, "target", "", "unix:///path.sock or host:port (grpc.NewClient)")
	flag.StringVar(&o.dialPath, "dial-path", "", "socket path for grpc.Dial with a unix dialer (kubelet/CSI pattern)")
	flag.StringVar(&o.requestID, "request-id", "interop-go", "x-request-id of CreateMachine")
	flag.StringVar(&o.createJSON, "create-json", "", "a valid CreateMachineRequest as protobuf JSON")
	flag.StringVar(&o.invalidRPC, "invalid-rpc", "CreateMachine", "CreateMachine or ApplyPool")
	flag.Parse()
	if *version {
		fmt.Printf("%s %s\n", client, grpc.Version)
		return
	}
	if (o.target == "") == (o.dialPath == "") || (o.invalidRPC != "CreateMachine" && o.invalidRPC != "ApplyPool") {
		fmt.Fprintln(os.Stderr, "usage: go-client (--target unix:///path.sock|host:port | --dial-path /path.sock) "+
			"[--request-id ID] [--create-json JSON] [--invalid-rpc CreateMachine|ApplyPool]")
		os.Exit(2)
	}
	s, err := run(o)
	if err != nil {
		where := o.target
		if o.dialPath != "" {
			where = "dial-path " + o.dialPath
		}
		fmt.Fprintf(os.Stderr, "interop check failed (%s %s, %s): %v\n", client, grpc.Version, where, err)
		os.Exit(1)
	}
	out, _ := json.Marshal(s)
	fmt.Println(string(out))
}
