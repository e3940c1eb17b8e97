module machinedriver.dev/bench/grpcgoserver

go 1.26.0

require (
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
	machinedriver.dev/go-driver v0.0.0
)

require (
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20261026165753-2ffab32bce7e // indirect
)

// The machinedriver.v1 stubs generated (and committed) by examples/go-driver/generate.sh.
replace machinedriver.dev/go-driver => ../../../examples/go-driver
