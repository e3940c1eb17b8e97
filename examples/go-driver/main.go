// Command go-driver is a machinedriver.v1 driver sidecar written in Go from the protocol's
// .proto files alone: no Rust, no driver-sdk. Machines live in memory; creates are long-running
// (done after --create-polls polls and --create-latency); operation tokens are sealed with
// HMAC-SHA256; every call has a request ID; every error carries the protocol's details.
//
//	go-driver --endpoint unix:///tmp/go-driver.sock --dev
//	driver-conformance --endpoint unix:///tmp/go-driver.sock
//
// docs/src/developer/writing-a-driver.md walks through it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	"google.golang.org/protobuf/types/known/structpb"

	// The google.rpc error details are registered for reflection, so grpcurl prints them.
	_ "google.golang.org/genproto/googleapis/rpc/errdetails"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

const (
	driverName = "go.machinedriver.dev"
	version    = "0.1.0"
)

type config struct {
	endpoint     string
	keyFile      string
	dev          bool
	create       pace
	delete       pace
	drainTimeout time.Duration
	eventDir     string
}

func parseFlags(args []string) (config, error) {
	var c config
	fl := flag.NewFlagSet("go-driver", flag.ContinueOnError)
	fl.StringVar(&c.endpoint, "endpoint", envOr("DRIVER_ENDPOINT", "unix:///run/machine-driver/driver.sock"),
		"unix:///path/to/driver.sock, tcp://host:port or host:port (env DRIVER_ENDPOINT)")
	fl.StringVar(&c.keyFile, "token-key-file", os.Getenv("DRIVER_TOKEN_KEY_FILE"),
		"file of operation token keys, one per line: the first seals, all verify (env DRIVER_TOKEN_KEY_FILE)")
	fl.BoolVar(&c.dev, "dev", os.Getenv("DRIVER_DEV_MODE") == "true",
		"without a key file, seal tokens with a random key (tokens do not survive a restart; env DRIVER_DEV_MODE=true)")
	fl.IntVar(&c.create.polls, "create-polls", 2, "polls a create needs before it is done")
	fl.DurationVar(&c.create.latency, "create-latency", 500*time.Millisecond, "time a create needs before it is done")
	fl.IntVar(&c.delete.polls, "delete-polls", 1, "polls a delete needs before it is done")
	fl.DurationVar(&c.delete.latency, "delete-latency", 200*time.Millisecond, "time a delete needs before it is done")
	fl.DurationVar(&c.drainTimeout, "drain-timeout", 30*time.Second, "on SIGTERM, how long in-flight calls may finish")
	fl.StringVar(&c.eventDir, "event-dir", os.Getenv("DRIVER_EVENT_DIR"),
		"advertise EVENTS: a file <machine>.<KIND> dropped here (e.g. web-0.SPOT_INTERRUPTION) is streamed as that machine's event until acknowledged, then removed (env DRIVER_EVENT_DIR)")
	if err := fl.Parse(args); err != nil {
		return c, err
	}
	if fl.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q", fl.Arg(0))
	}
	if c.create.polls < 0 || c.delete.polls < 0 || c.create.latency < 0 || c.delete.latency < 0 {
		return c, errors.New("--create-polls, --delete-polls and the latencies must not be negative")
	}
	return c, nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func main() {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	cfg, err := parseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "go-driver:", err)
		os.Exit(2)
	}
	if err := run(cfg, log); err != nil {
		fmt.Fprintln(os.Stderr, "go-driver:", err)
		os.Exit(1)
	}
}

func run(cfg config, log *slog.Logger) error {
	keys, random, err := loadKeys(cfg.keyFile, cfg.dev)
	if err != nil {
		return err
	}
	if random {
		log.Warn("dev mode: operation tokens are sealed with a random key and do not survive a restart")
	}
	schema, err := structpb.NewStruct(providerSpecSchema())
	if err != nil {
		return fmt.Errorf("provider spec schema: %w", err)
	}
	d := &driver{
		name:    driverName,
		version: version,
		schema:  schema,
		cloud:   newCloud(cfg.create, cfg.delete),
		tokens:  &tokenCodec{driver: driverName, keys: keys},
		log:     log,
	}
	if cfg.eventDir != "" {
		d.events = newEventHub()
	}

	lis, cleanup, err := listen(cfg.endpoint)
	if err != nil {
		return err
	}
	defer cleanup()

	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(unaryInterceptor(driverName, log)),
		grpc.ChainStreamInterceptor(streamInterceptor),
		// The controller pings only during calls, at most every 5 min: grpc-go's default
		// enforcement policy accepts that as it is. We ping idle callers to notice dead ones.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
	)
	pb.RegisterIdentityServer(srv, identityServer{driver: d})
	pb.RegisterMachinesServer(srv, machinesServer{driver: d})
	pb.RegisterPoolsServer(srv, poolsServer{})
	pb.RegisterOperationsServer(srv, operationsServer{driver: d})
	// Registered always, so that without --event-dir it answers CAPABILITY_NOT_SUPPORTED with details.
	pb.RegisterEventsServer(srv, eventsServer{driver: d})
	healthSrv := health.NewServer()
	healthpb.RegisterHealthServer(srv, healthSrv)
	reflection.Register(srv) // v1 and v1alpha (grpcurl 1.8 asks v1alpha)

	// Probe is ready at once (nothing to log in to), so health says SERVING from the start.
	for _, svc := range []string{"", "machinedriver.v1.Identity", "machinedriver.v1.Machines",
		"machinedriver.v1.Pools", "machinedriver.v1.Events", "machinedriver.v1.Operations"} {
		healthSrv.SetServingStatus(svc, healthpb.HealthCheckResponse_SERVING)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if cfg.eventDir != "" {
		if err := os.MkdirAll(cfg.eventDir, 0o755); err != nil {
			return fmt.Errorf("--event-dir: %w", err)
		}
		go d.watchEventDir(ctx, cfg.eventDir)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	// The bound address tells callers the port when the endpoint asked for port 0.
	log.Info("go-driver serving", "endpoint", cfg.endpoint, "address", lis.Addr().String(), "driver", driverName,
		"version", version, "create.polls", cfg.create.polls, "create.latency", cfg.create.latency)

	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	// Drain: report NOT_SERVING, let in-flight calls finish for a while, then close the rest.
	log.Info("shutting down", "drain.timeout", cfg.drainTimeout)
	healthSrv.Shutdown()
	if d.events != nil {
		d.events.close() // event streams never end by themselves
	}
	drained := make(chan struct{})
	go func() { srv.GracefulStop(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(cfg.drainTimeout):
		srv.Stop()
	}
	return nil
}

// listen opens the endpoint. For a Unix socket it creates the folder, removes a stale socket
// (one nobody accepts on), refuses a live one or a non-socket file, makes the socket 0660, and
// returns a cleanup that removes it.
func listen(endpoint string) (net.Listener, func(), error) {
	noop := func() {}
	path, isUnix := strings.CutPrefix(endpoint, "unix://")
	if !isUnix {
		addr := strings.TrimPrefix(endpoint, "tcp://")
		if _, _, err := net.SplitHostPort(addr); err != nil || strings.Contains(addr, "://") {
			return nil, noop, fmt.Errorf("endpoint %q: expected unix:///path/to/driver.sock, tcp://host:port or host:port", endpoint)
		}
		lis, err := net.Listen("tcp", addr)
		return lis, noop, err
	}
	if path == "" {
		return nil, noop, fmt.Errorf("endpoint %q: no socket path", endpoint)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, noop, err
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&fs.ModeSocket == 0 {
			return nil, noop, fmt.Errorf("%s exists and is not a socket; refusing to replace it", path)
		}
		if conn, err := net.DialTimeout("unix", path, time.Second); err == nil {
			conn.Close()
			return nil, noop, fmt.Errorf("another process is already serving on %s", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, noop, fmt.Errorf("removing stale socket: %w", err)
		}
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, noop, err
	}
	if err := os.Chmod(path, 0o660); err != nil {
		lis.Close()
		return nil, noop, err
	}
	return lis, func() { _ = os.Remove(path) }, nil
}
