package main

// The EVENTS capability: an event source (a folder the operator or a test drops files into,
// standing in for a cloud's queue) and the at-least-once bookkeeping the protocol asks of every
// driver — keep each event until AckEvents names it, send it again after the stream's
// ack_deadline, keepalives on an idle stream, resume tokens "<epoch>.<seq>", and streams that
// end UNAVAILABLE when the driver drains.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

const (
	defaultKeepalive   = 15 * time.Second
	defaultAckDeadline = 30 * time.Second
	minInterval        = time.Second
	maxKeepalive       = 5 * time.Minute
	maxAckDeadline     = time.Hour
	// How often the event folder is read.
	eventDirPoll = 200 * time.Millisecond
)

type pendingEvent struct {
	event *pb.MachineEvent
	file  string // the source to let go on the acknowledgement
}

// sentEvent is what one stream sent of one event: when (its ack deadline runs from then) and
// how often.
type sentEvent struct {
	at       time.Time
	attempts uint32
}

// eventHub holds the events not acknowledged yet. Every stream waits on `changed`, which is
// closed (and replaced) whenever an event arrives or the hub closes.
type eventHub struct {
	mu      sync.Mutex
	epoch   string
	nextSeq uint64
	pending map[uint64]*pendingEvent
	byID    map[string]uint64
	changed chan struct{}
	closed  bool
}

func newEventHub() *eventHub {
	return &eventHub{epoch: newUUID()[:8], nextSeq: 1, pending: map[uint64]*pendingEvent{},
		byID: map[string]uint64{}, changed: make(chan struct{})}
}

func (h *eventHub) token(seq uint64) string { return fmt.Sprintf("%s.%d", h.epoch, seq) }

// wake tells every stream to look again. Called with mu held.
func (h *eventHub) wake() {
	close(h.changed)
	h.changed = make(chan struct{})
}

// offer keeps an event unless its ID is pending already.
func (h *eventHub) offer(ev *pb.MachineEvent, file string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.byID[ev.EventId]; ok {
		return
	}
	if file != "" {
		// Acknowledged (and removed) since the folder was read: not again.
		if _, err := os.Stat(file); err != nil {
			return
		}
	}
	seq := h.nextSeq
	h.nextSeq++
	h.byID[ev.EventId] = seq
	h.pending[seq] = &pendingEvent{event: ev, file: file}
	h.wake()
}

// close ends every stream (the driver drains).
func (h *eventHub) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.closed {
		h.closed = true
		h.wake()
	}
}

// ack forgets an event and removes its file; false when the ID is not pending.
func (h *eventHub) ack(id string) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	seq, ok := h.byID[id]
	if !ok {
		return false, nil
	}
	if f := h.pending[seq].file; f != "" {
		if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
			return false, newError(codes.Unavailable, "EVENT_SOURCE_UNAVAILABLE", "removing the event file: %v", err)
		}
	}
	delete(h.pending, seq)
	delete(h.byID, id)
	return true, nil
}

// dueEvent is one event a stream sends now, with its sequence number.
type dueEvent struct {
	seq   uint64
	event *pb.MachineEvent
}

// due returns what a stream sends now — events it has not sent, and events it sent more than
// ackDeadline ago that are still pending — counting this stream's attempts in `sent`, and when
// the next one falls due.
func (h *eventHub) due(sent map[uint64]*sentEvent, now time.Time, ackDeadline time.Duration) ([]dueEvent, time.Time, bool, <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for seq := range sent {
		if _, ok := h.pending[seq]; !ok {
			delete(sent, seq)
		}
	}
	seqs := make([]uint64, 0, len(h.pending))
	for seq := range h.pending {
		seqs = append(seqs, seq)
	}
	sort.Slice(seqs, func(i, j int) bool { return seqs[i] < seqs[j] })
	var out []dueEvent
	var next time.Time
	for _, seq := range seqs {
		se, ok := sent[seq]
		if !ok {
			se = &sentEvent{}
			sent[seq] = se
		}
		if !ok || !se.at.Add(ackDeadline).After(now) {
			se.attempts++
			se.at = now
			ev := proto.Clone(h.pending[seq].event).(*pb.MachineEvent)
			ev.DeliveryAttempt = se.attempts
			out = append(out, dueEvent{seq: seq, event: ev})
		}
		if d := se.at.Add(ackDeadline); next.IsZero() || d.Before(next) {
			next = d
		}
	}
	return out, next, h.closed, h.changed
}

// ------------------------------------------------------------------------------ the source

// kinds by the file suffix a test or an operator uses: "<machine>.<KIND>".
var eventKinds = map[string]pb.MachineEventKind{
	"SPOT_INTERRUPTION":                 pb.MachineEventKind_MACHINE_EVENT_KIND_SPOT_INTERRUPTION,
	"REBALANCE_RECOMMENDATION":          pb.MachineEventKind_MACHINE_EVENT_KIND_REBALANCE_RECOMMENDATION,
	"SCHEDULED_MAINTENANCE":             pb.MachineEventKind_MACHINE_EVENT_KIND_SCHEDULED_MAINTENANCE,
	"STOPPING":                          pb.MachineEventKind_MACHINE_EVENT_KIND_STOPPING,
	"STOPPED":                           pb.MachineEventKind_MACHINE_EVENT_KIND_STOPPED,
	"TERMINATED":                        pb.MachineEventKind_MACHINE_EVENT_KIND_TERMINATED,
	"IMPAIRED":                          pb.MachineEventKind_MACHINE_EVENT_KIND_IMPAIRED,
	"CAPACITY_RESERVATION_INTERRUPTION": pb.MachineEventKind_MACHINE_EVENT_KIND_CAPACITY_RESERVATION_INTERRUPTION,
}

// cloudAction is what the cloud does at the event's deadline, by kind.
func cloudAction(k pb.MachineEventKind) pb.CloudAction {
	switch k {
	case pb.MachineEventKind_MACHINE_EVENT_KIND_SPOT_INTERRUPTION, pb.MachineEventKind_MACHINE_EVENT_KIND_TERMINATED,
		pb.MachineEventKind_MACHINE_EVENT_KIND_CAPACITY_RESERVATION_INTERRUPTION:
		return pb.CloudAction_CLOUD_ACTION_TERMINATE
	case pb.MachineEventKind_MACHINE_EVENT_KIND_STOPPING, pb.MachineEventKind_MACHINE_EVENT_KIND_STOPPED:
		return pb.CloudAction_CLOUD_ACTION_STOP
	case pb.MachineEventKind_MACHINE_EVENT_KIND_SCHEDULED_MAINTENANCE:
		return pb.CloudAction_CLOUD_ACTION_REBOOT
	}
	return pb.CloudAction_CLOUD_ACTION_UNSPECIFIED
}

// watchEventDir turns every file "<machine>.<KIND>" in dir into an event (its ID from the file
// name and modification time, so a restarted driver sends the same event again) until ctx ends.
// A file stays until its event is acknowledged: the folder is the durable source.
func (d *driver) watchEventDir(ctx context.Context, dir string) {
	tick := time.NewTicker(eventDirPoll)
	defer tick.Stop()
	for {
		entries, err := os.ReadDir(dir)
		if err != nil {
			d.log.Warn("reading the event folder", "dir", dir, "error", err)
		}
		for _, e := range entries {
			machine, kindName, ok := strings.Cut(e.Name(), ".")
			kind, known := eventKinds[kindName]
			info, ierr := e.Info()
			if !ok || !known || ierr != nil || e.IsDir() {
				continue
			}
			m, found := d.cloud.get(machine)
			if !found {
				continue // not ours (yet): left alone
			}
			at := info.ModTime()
			d.events.offer(&pb.MachineEvent{
				EventId:     fmt.Sprintf("go-%s-%s-%d", machine, strings.ToLower(kindName), at.UnixNano()),
				MachineName: machine,
				ProviderId:  m.ProviderId,
				Kind:        kind,
				ObservedAt:  timestamppb.New(at),
				Action:      cloudAction(kind),
				Offering:    &pb.Offering{CapacityType: pb.CapacityType_CAPACITY_TYPE_ON_DEMAND},
			}, filepath.Join(dir, e.Name()))
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// ------------------------------------------------------------------------------ the service

type eventsServer struct {
	pb.UnimplementedEventsServer
	*driver
}

// interval reads an optional duration field: unset is def, negative a violation, anything
// else clamped to [minInterval, upper].
func interval(v *invalidRequest, field string, d *durationpb.Duration, def, upper time.Duration) time.Duration {
	if d == nil {
		return def
	}
	if d.Seconds < 0 || d.Nanos < 0 {
		v.add(reasonFieldInvalid, field, "must not be negative")
		return def
	}
	return min(max(d.AsDuration(), minInterval), upper)
}

func (s eventsServer) WatchEvents(req *pb.WatchEventsRequest, stream grpc.ServerStreamingServer[pb.WatchEventsResponse]) error {
	ctx := stream.Context()
	requestID := acceptRequestID(ctx)
	fail := func(err error) error { return toStatus(err, s.name, requestID) }
	if s.events == nil {
		return fail(errUnadvertised("WatchEvents"))
	}
	var v invalidRequest
	keepalive := interval(&v, "keepalive_interval", req.KeepaliveInterval, defaultKeepalive, maxKeepalive)
	ackDeadline := interval(&v, "ack_deadline", req.AckDeadline, defaultAckDeadline, maxAckDeadline)
	sent := map[uint64]*sentEvent{}
	start := time.Now()
	var high uint64 // the highest sequence number the caller has: what its resume token says
	if req.ResumeToken != "" {
		epoch, seqText, ok := strings.Cut(req.ResumeToken, ".")
		seq, err := strconv.ParseUint(seqText, 10, 64)
		switch {
		case !ok || err != nil:
			v.add(reasonFieldInvalid, "resume_token", "is not a token this driver sent")
		case epoch == s.events.epoch:
			// Received on the caller's earlier stream: due again one ack deadline from now.
			s.events.mu.Lock()
			for p := range s.events.pending {
				if p <= seq {
					sent[p] = &sentEvent{at: start, attempts: 1}
				}
			}
			s.events.mu.Unlock()
			high = seq
		}
	}
	if err := v.err(); err != nil {
		return fail(err)
	}
	_ = stream.SetHeader(metadata.Pairs(requestIDHeader, requestID))
	lastSent := start
	for {
		events, nextDue, closed, changed := s.events.due(sent, time.Now(), ackDeadline)
		if closed {
			return fail(newError(codes.Unavailable, "DRIVER_DRAINING", "the driver is shutting down; reconnect with the last resume_token"))
		}
		for _, d := range events {
			high = max(high, d.seq)
			d.event.ResumeToken = s.events.token(high)
			if err := stream.Send(&pb.WatchEventsResponse{Item: &pb.WatchEventsResponse_Event{Event: d.event}}); err != nil {
				return err
			}
			// The ack deadline runs from when the caller could have the event.
			lastSent = time.Now()
			sent[d.seq].at = lastSent
		}
		keepaliveAt := lastSent.Add(keepalive)
		wake := keepaliveAt
		if !nextDue.IsZero() && nextDue.Before(wake) {
			wake = nextDue
		}
		timer := time.NewTimer(time.Until(wake))
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil
		case <-changed:
			timer.Stop()
		case <-timer.C:
			if !time.Now().Before(keepaliveAt) {
				ka := &pb.Keepalive{Time: timestamppb.Now(), ResumeToken: s.events.token(high)}
				if err := stream.Send(&pb.WatchEventsResponse{Item: &pb.WatchEventsResponse_Keepalive{Keepalive: ka}}); err != nil {
					return err
				}
				lastSent = time.Now()
			}
		}
	}
}

func (s eventsServer) AckEvents(ctx context.Context, req *pb.AckEventsRequest) (*pb.AckEventsResponse, error) {
	if s.events == nil {
		return nil, errUnadvertised("AckEvents")
	}
	var v invalidRequest
	if len(req.EventIds) == 0 {
		v.add(reasonFieldRequired, "event_ids", "is required")
	}
	for i, id := range req.EventIds {
		if id == "" {
			v.add(reasonFieldInvalid, fmt.Sprintf("event_ids[%d]", i), "must not be empty")
		}
	}
	if err := v.err(); err != nil {
		return nil, err
	}
	resp := &pb.AckEventsResponse{}
	for _, id := range req.EventIds {
		acked, err := s.events.ack(id)
		if err != nil {
			return nil, err
		}
		if acked {
			resp.AckedEventIds = append(resp.AckedEventIds, id)
		} else {
			resp.UnknownEventIds = append(resp.UnknownEventIds, id)
		}
	}
	return resp, nil
}
