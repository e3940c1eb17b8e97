// Command grpc-go-server is the grpc-go peer of the SDK overhead benchmark
// (tests/benches/sdk_overhead.rs): the generated machinedriver.v1 Machines service on grpc-go's
// defaults, answering GetMachineStatus with a fixed Machine read from a file, on a Unix socket.
// Nothing else: no interceptors, no logging, no health or reflection. It is the Go counterpart
// of the bench's bare tonic server, built from the same .proto files (the Go driver's stubs in
// examples/go-driver/gen, reached through a replace directive in go.mod).
//
//	grpc-go-server <socket> <machine.pb>
//	grpc-go-server --version
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime"
	"runtime/debug"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

type machines struct {
	pb.UnimplementedMachinesServer
	machine *pb.Machine
}

// GetMachineStatus answers the fixed Machine (shared, read-only: grpc-go only marshals it).
func (m *machines) GetMachineStatus(_ context.Context, req *pb.GetMachineStatusRequest) (*pb.Machine, error) {
	if req.GetName() != m.machine.GetName() {
		return nil, status.Error(codes.NotFound, "no such machine")
	}
	return m.machine, nil
}

func version() string {
	v := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "google.golang.org/grpc" {
				v = d.Version
			}
		}
	}
	return fmt.Sprintf("grpc-go %s, %s", v, runtime.Version())
}

func main() {
	if len(os.Args) == 2 && os.Args[1] == "--version" {
		fmt.Println(version())
		return
	}
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: grpc-go-server <socket> <machine.pb> | --version")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2]); err != nil {
		fmt.Fprintln(os.Stderr, "grpc-go-server:", err)
		os.Exit(1)
	}
}

func run(socket, machineFile string) error {
	raw, err := os.ReadFile(machineFile)
	if err != nil {
		return err
	}
	machine := &pb.Machine{}
	if err := proto.Unmarshal(raw, machine); err != nil {
		return fmt.Errorf("%s: %w", machineFile, err)
	}
	lis, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	srv := grpc.NewServer()
	pb.RegisterMachinesServer(srv, &machines{machine: machine})
	fmt.Fprintln(os.Stderr, "serving on unix://"+socket, version())
	return srv.Serve(lis)
}
