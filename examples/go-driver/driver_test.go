package main

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

func codeAndReason(t *testing.T, err error) (codes.Code, string) {
	t.Helper()
	var de *driverError
	if !errors.As(err, &de) {
		t.Fatalf("want a driverError, got %v", err)
	}
	return de.code, de.reason
}

func TestTokenRoundTripAndRefusals(t *testing.T) {
	c := &tokenCodec{driver: driverName, keys: [][]byte{[]byte("0123456789abcdef-new"), []byte("0123456789abcdef-old")}}
	p := tokenPayload{Driver: driverName, Op: "op-1", Kind: pb.OperationKind_OPERATION_KIND_CREATE_MACHINE, Target: "m", Start: 1}
	tok := c.seal(p)
	if got, err := c.open(tok); err != nil || got != p {
		t.Fatalf("open(seal(p)) = %v, %v", got, err)
	}
	// Every single-bit flip anywhere is refused, never acted on.
	for i := range tok {
		bad := append([]byte(nil), tok...)
		bad[i] ^= 1
		if _, err := c.open(bad); err == nil {
			t.Fatalf("flipped byte %d accepted", i)
		} else if _, r := codeAndReason(t, err); r != reasonOperationTokenInvalid {
			t.Fatalf("flipped byte %d: reason %s", i, r)
		}
	}
	if _, err := c.open(nil); err == nil {
		t.Fatal("empty token accepted")
	} else if code, r := codeAndReason(t, err); code != codes.InvalidArgument || r != reasonFieldRequired {
		t.Fatalf("empty token: %v %s", code, r)
	}
	for name, tok := range map[string][]byte{
		"truncated":    tok[:20],
		"version":      append([]byte{2}, tok[1:]...),
		"other key":    (&tokenCodec{driver: driverName, keys: [][]byte{[]byte("another key, 16+ bytes")}}).seal(p),
		"other driver": (&tokenCodec{driver: "other.machinedriver.dev", keys: c.keys}).seal(p),
	} {
		if _, err := c.open(tok); err == nil {
			t.Fatalf("%s: accepted", name)
		} else if code, r := codeAndReason(t, err); code != codes.InvalidArgument || r != reasonOperationTokenInvalid {
			t.Fatalf("%s: %v %s", name, code, r)
		}
	}
	// Rotation: a token sealed with the old key (now second) still opens.
	old := (&tokenCodec{driver: driverName, keys: c.keys[1:]}).seal(p)
	if _, err := c.open(old); err != nil {
		t.Fatalf("token of the old key refused: %v", err)
	}
}

func TestLoadKeys(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "keys")
	if err := os.WriteFile(file, []byte("# new key first\n0123456789abcdef-new\n\n0123456789abcdef-old  \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	keys, random, err := loadKeys(file, false)
	if err != nil || random || len(keys) != 2 || string(keys[1]) != "0123456789abcdef-old" {
		t.Fatalf("loadKeys = %q, %v, %v", keys, random, err)
	}
	if err := os.WriteFile(file, []byte("short\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := loadKeys(file, true); err == nil {
		t.Fatal("short key accepted")
	}
	if _, _, err := loadKeys("", false); err == nil {
		t.Fatal("no key and no dev mode accepted")
	}
	if keys, random, err := loadKeys("", true); err != nil || !random || len(keys[0]) != 32 {
		t.Fatalf("dev mode: %v %v %v", keys, random, err)
	}
}

func spec(t *testing.T, m map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestValidationCollectsEveryViolationAndTheFirstDecides(t *testing.T) {
	var v invalidRequest
	checkName(&v, "name", "Not_Valid")
	checkSpec(&v, "provider_spec", spec(t, map[string]any{"size": "huge", "colour": "red", "tags": map[string]any{"a": 1.0}}))
	code, reason := codeAndReason(t, v.err())
	if code != codes.InvalidArgument || reason != reasonFieldInvalid {
		t.Fatalf("%v %s", code, reason)
	}
	var fields []string
	for _, fv := range v.violations {
		fields = append(fields, fv.Field)
	}
	want := []string{"name", "provider_spec.size", "provider_spec.tags.a", "provider_spec.colour"}
	if len(fields) != len(want) {
		t.Fatalf("fields %v, want %v", fields, want)
	}
	for i := range want {
		if fields[i] != want[i] {
			t.Fatalf("fields %v, want %v", fields, want)
		}
	}
	for _, ex := range providerSpecSchema()["examples"].([]any) {
		var ok invalidRequest
		checkSpec(&ok, "provider_spec", spec(t, ex.(map[string]any)))
		if ok.err() != nil {
			t.Fatalf("schema example %v is invalid: %v", ex, ok.err())
		}
	}
}

func TestCreateNeedsTwoPollsAndADeleteOvertakesIt(t *testing.T) {
	c := newCloud(pace{polls: 2}, pace{polls: 1})
	st, fresh, err := c.startCreate("m", "h1", nil)
	if err != nil || !fresh || st.done {
		t.Fatalf("start: %+v %v %v", st, fresh, err)
	}
	if again, fresh, _ := c.startCreate("m", "h1", nil); fresh || again.token.Op != st.token.Op {
		t.Fatal("a repeated create did not return the operation in flight")
	}
	if _, _, err := c.startCreate("m", "h2", nil); err == nil {
		t.Fatal("another spec accepted")
	} else if code, _ := codeAndReason(t, err); code != codes.AlreadyExists {
		t.Fatalf("another spec: %v", code)
	}
	if c.poll(st.token, true).done {
		t.Fatal("done after one poll")
	}
	if c.poll(st.token, false).done {
		t.Fatal("a look without advancing finished it")
	}
	done := c.poll(st.token, true)
	if !done.done || done.machine.GetState() != pb.MachineState_MACHINE_STATE_RUNNING {
		t.Fatalf("after two polls: %+v", done)
	}

	st2, _, _ := c.startCreate("n", "h1", nil)
	del := c.startDelete("n")
	if got := c.poll(st2.token, true); !got.done || got.err == nil || got.err.reason != reasonOperationCancelled {
		t.Fatalf("create overtaken by a delete: %+v", got)
	}
	if !c.poll(del.token, true).done {
		t.Fatal("delete not done after its poll")
	}
	if _, ok := c.get("n"); ok {
		t.Fatal("deleted machine still there")
	}
	if got := c.poll(st2.token, true); got.err == nil || got.err.code != codes.NotFound {
		t.Fatalf("create of a vanished machine: %+v", got)
	}
}

func TestLatencyIsHonoured(t *testing.T) {
	c := newCloud(pace{polls: 1, latency: time.Hour}, pace{})
	now := time.Unix(1000, 0)
	c.now = func() time.Time { return now }
	st, _, _ := c.startCreate("m", "h", nil)
	if c.poll(st.token, true).done {
		t.Fatal("done before its latency")
	}
	now = now.Add(time.Hour)
	if !c.poll(st.token, true).done {
		t.Fatal("not done after its latency")
	}
}

func TestRequestIDs(t *testing.T) {
	for id, ok := range map[string]bool{"abc-123": true, "": false, "has space": false, "é": false, string(make([]byte, 129)): false} {
		if validRequestID(id) != ok {
			t.Fatalf("validRequestID(%q) != %v", id, ok)
		}
	}
	if u := newUUID(); len(u) != 36 || u[14] != '4' {
		t.Fatalf("not a UUID v4: %s", u)
	}
}
