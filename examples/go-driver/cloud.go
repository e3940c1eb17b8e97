package main

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

// cloud is the in-memory stand-in for a cloud API: machines keyed by name, and at most one
// operation in flight per machine. Work advances only when an operation is polled (and its
// latency has passed), like a cloud whose state a driver observes through its status API.
// It keeps no operation table: a poll finds its operation through the machine, from what the
// token carries (operation ID, kind, target).
type cloud struct {
	mu       sync.Mutex
	machines map[string]*vm
	creates  pace
	deletes  pace
	now      func() time.Time
	seq      int // numbers the machines, for their addresses
}

// pace says when an operation is done: after `polls` polls and `latency` since it started.
type pace struct {
	polls   int
	latency time.Duration
}

type vm struct {
	name, providerID, address string
	specHash                  string
	labels                    map[string]string
	state                     pb.MachineState
	created                   time.Time
	createOp                  string // the operation that created it
	ready                     bool   // that operation finished
	op                        *inFlight
}

type inFlight struct {
	id    string
	kind  pb.OperationKind
	start time.Time
	polls int
}

// opState is what a mutating call or a poll reports; the service layer turns it into an
// Operation (token, timestamps, the error as a google.rpc.Status).
type opState struct {
	token     tokenPayload
	done      bool
	machine   *pb.Machine  // create, done and successful
	err       *driverError // done and failed
	progress  int32
	pollAfter time.Duration
}

func newCloud(create, del pace) *cloud {
	return &cloud{machines: map[string]*vm{}, creates: create, deletes: del, now: time.Now}
}

func randomID(prefix string) string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// startCreate is CreateMachine's idempotency rule: same name and spec returns the in-flight
// operation or, once finished, a done one with the machine; another spec is ALREADY_EXISTS.
// `fresh` tells whether a machine was created (the log's ground truth for "created once").
func (c *cloud) startCreate(name, hash string, labels map[string]string) (st opState, fresh bool, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if m, ok := c.machines[name]; ok {
		switch {
		case m.op != nil && m.op.kind == pb.OperationKind_OPERATION_KIND_DELETE_MACHINE:
			return st, false, newError(codes.Aborted, reasonOperationPending,
				"machine %s is being deleted; create it again once the delete is done", name)
		case m.specHash != hash:
			return st, false, newError(codes.AlreadyExists, reasonMachineSpecConflict,
				"machine %s exists with another provider spec", name)
		case m.op != nil:
			return c.view(m, m.op, now), false, nil
		}
		// Work found already done: a fresh, done operation that reports the machine.
		return opState{token: payload(randomID("create-"), pb.OperationKind_OPERATION_KIND_CREATE_MACHINE, name, now),
			done: true, machine: m.proto(), progress: 100}, false, nil
	}
	id := randomID("op-")
	c.seq++
	m := &vm{
		name:       name,
		providerID: "go:///" + randomID("vm-"),
		address:    fmt.Sprintf("10.%d.%d.%d", c.seq>>16&255, c.seq>>8&255, c.seq&255),
		specHash:   hash,
		labels:     labels,
		state:      pb.MachineState_MACHINE_STATE_CREATING,
		created:    now,
		createOp:   id,
		op:         &inFlight{id: id, kind: pb.OperationKind_OPERATION_KIND_CREATE_MACHINE, start: now},
	}
	c.machines[name] = m
	return c.view(m, m.op, now), true, nil
}

// startDelete: deleting an absent machine is a done operation; a delete in flight is returned
// again; a delete overrides a create in flight (whose poll then reports OPERATION_CANCELLED), so
// a scale-down never waits for a create it is about to undo.
func (c *cloud) startDelete(name string) opState {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	m, ok := c.machines[name]
	if !ok {
		return opState{token: payload(randomID("delete-"), pb.OperationKind_OPERATION_KIND_DELETE_MACHINE, name, now),
			done: true, progress: 100}
	}
	if m.op == nil || m.op.kind != pb.OperationKind_OPERATION_KIND_DELETE_MACHINE {
		m.op = &inFlight{id: randomID("op-"), kind: pb.OperationKind_OPERATION_KIND_DELETE_MACHINE, start: now}
		m.state = pb.MachineState_MACHINE_STATE_DELETING
	}
	return c.view(m, m.op, now)
}

// poll is one look at an operation. With advance, it counts as a poll and may finish the work
// (GetOperation, WaitOperation); without, it only reports (CancelOperation, which this driver
// does not support, answers with the operation unchanged).
func (c *cloud) poll(p tokenPayload, advance bool) opState {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	m := c.machines[p.Target]
	done := opState{token: p, done: true, progress: 100}
	switch p.Kind {
	case pb.OperationKind_OPERATION_KIND_CREATE_MACHINE:
		switch {
		case m == nil:
			// Deleted since, or this driver restarted and its in-memory cloud is gone.
			done.err = newError(codes.NotFound, reasonOperationNotFound,
				"operation %s: machine %s no longer exists", p.Op, p.Target)
		case m.op != nil && m.op.id == p.Op:
			if advance {
				c.advance(m, now)
			}
			if m.op != nil {
				return c.view(m, m.op, now)
			}
			done.machine = m.proto()
		case m.createOp == p.Op && !m.ready:
			done.err = newError(codes.Canceled, reasonOperationCancelled,
				"operation %s: the create of %s was overtaken by a delete", p.Op, p.Target)
		default:
			// Finished earlier (or work found done): report the machine as it is now.
			done.machine = m.proto()
		}
	case pb.OperationKind_OPERATION_KIND_DELETE_MACHINE:
		if m != nil && m.op != nil && m.op.id == p.Op {
			if advance {
				c.advance(m, now)
			}
			if m.op != nil {
				return c.view(m, m.op, now)
			}
		}
		// Gone (or the name was reused after this delete finished): the delete is done.
	}
	return done
}

// advance counts a poll and finishes the operation when its pace allows.
func (c *cloud) advance(m *vm, now time.Time) {
	op := m.op
	op.polls++
	pace := c.pace(op.kind)
	if op.polls < pace.polls || now.Sub(op.start) < pace.latency {
		return
	}
	m.op = nil
	if op.kind == pb.OperationKind_OPERATION_KIND_DELETE_MACHINE {
		delete(c.machines, m.name)
		return
	}
	m.state, m.ready = pb.MachineState_MACHINE_STATE_RUNNING, true
}

func (c *cloud) pace(kind pb.OperationKind) pace {
	if kind == pb.OperationKind_OPERATION_KIND_DELETE_MACHINE {
		return c.deletes
	}
	return c.creates
}

// view reports a running operation, with progress and the time to poll again: what is left of
// the latency, at least 50 ms and at most 2 s.
func (c *cloud) view(m *vm, op *inFlight, now time.Time) opState {
	pace := c.pace(op.kind)
	left := pace.latency - now.Sub(op.start)
	progress := int32(99)
	if pace.latency > 0 && left > 0 {
		progress = int32(min(99, 100*now.Sub(op.start)/pace.latency))
	}
	if pace.polls > 0 {
		progress = min(progress, int32(99*op.polls/pace.polls))
	}
	return opState{
		token:     payload(op.id, op.kind, m.name, op.start),
		progress:  progress,
		pollAfter: min(max(left, 50*time.Millisecond), 2*time.Second),
	}
}

func payload(id string, kind pb.OperationKind, target string, start time.Time) tokenPayload {
	return tokenPayload{Op: id, Kind: kind, Target: target, Start: start.UnixMilli()}
}

func (c *cloud) get(name string) (*pb.Machine, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.machines[name]; ok {
		return m.proto(), true
	}
	return nil, false
}

// list returns up to `size` machines after `after` (by name) whose labels include `selector`,
// and whether more follow.
func (c *cloud) list(selector map[string]string, after string, size int) ([]*pb.Machine, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	names := make([]string, 0, len(c.machines))
	for n := range c.machines {
		if n > after {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	var out []*pb.Machine
	for _, n := range names {
		m := c.machines[n]
		if !matches(m.labels, selector) {
			continue
		}
		if len(out) == size {
			return out, true
		}
		out = append(out, m.proto())
	}
	return out, false
}

func matches(labels, selector map[string]string) bool {
	for k, v := range selector {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func (m *vm) proto() *pb.Machine {
	labels := make(map[string]string, len(m.labels))
	for k, v := range m.labels {
		labels[k] = v
	}
	return &pb.Machine{
		Name:       m.name,
		ProviderId: m.providerID,
		State:      m.state,
		Addresses:  []*pb.Address{{Type: "InternalIP", Address: m.address}, {Type: "Hostname", Address: m.name}},
		Labels:     labels,
		Resources:  []*pb.ResourceStatus{{Kind: "vm", Id: m.providerID, State: m.state.String()}},
		CreateTime: timestamppb.New(m.created),
		SpecHash:   m.specHash,
	}
}
