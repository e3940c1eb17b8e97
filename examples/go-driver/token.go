package main

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"google.golang.org/grpc/codes"

	pb "machinedriver.dev/go-driver/gen/machinedriver/v1"
)

// Operation tokens. The protocol only says a token is opaque bytes, self-contained, versioned
// and integrity-protected; the layout is this driver's own:
//
//	byte 0        version (1)
//	bytes 1..n-32 payload: JSON tokenPayload
//	last 32 bytes HMAC-SHA256(key, version || payload)
//
// The token is signed, not encrypted: it holds nothing secret, only what a poll needs to find
// the operation again in the cloud.
const (
	tokenVersion = 1
	macLen       = sha256.Size
	minKeyLen    = 16
)

type tokenPayload struct {
	Driver string           `json:"d"` // a token from another driver is refused, even with a shared key
	Op     string           `json:"o"` // the cloud's operation ID
	Kind   pb.OperationKind `json:"k"`
	Target string           `json:"t"`
	Start  int64            `json:"s"` // start time, ms since the epoch
}

// tokenCodec seals with the first key and verifies with all of them, so keys can be rotated:
// put the new key first, keep the old one until no stored token needs it.
type tokenCodec struct {
	driver string
	keys   [][]byte
}

// seal writes the token of an operation, naming this driver in it.
func (c *tokenCodec) seal(p tokenPayload) []byte {
	p.Driver = c.driver
	body, _ := json.Marshal(p) // plain strings and integers: cannot fail
	out := append([]byte{tokenVersion}, body...)
	return append(out, mac(c.keys[0], out)...)
}

// open verifies a token. Nothing in a token that fails verification is acted on.
func (c *tokenCodec) open(token []byte) (tokenPayload, error) {
	var p tokenPayload
	invalid := func(msg, violation string) error {
		e := newError(codes.InvalidArgument, reasonOperationTokenInvalid, "operation token is invalid: %s", msg)
		if violation != "" {
			e.withViolation("token", violation)
		}
		return e
	}
	switch {
	case len(token) == 0:
		return p, newError(codes.InvalidArgument, reasonFieldRequired, "invalid request: token: required").
			withViolation("token", "required")
	case token[0] != tokenVersion:
		return p, invalid(fmt.Sprintf("version %d is not supported (this driver reads version %d)", token[0], tokenVersion), "unknown version")
	case len(token) < 1+2+macLen: // version, the shortest JSON object "{}", the MAC
		return p, invalid("truncated", "truncated")
	}
	signed, tag := token[:len(token)-macLen], token[len(token)-macLen:]
	ok := false
	for _, k := range c.keys {
		ok = ok || hmac.Equal(tag, mac(k, signed))
	}
	if !ok {
		return p, invalid("integrity check failed (altered, or sealed with another key)", "integrity check failed")
	}
	if err := json.Unmarshal(signed[1:], &p); err != nil {
		return p, invalid("payload is not this driver's", "malformed payload")
	}
	if p.Driver != c.driver {
		return p, invalid("sealed by another driver", "foreign driver")
	}
	if p.Kind != pb.OperationKind_OPERATION_KIND_CREATE_MACHINE && p.Kind != pb.OperationKind_OPERATION_KIND_DELETE_MACHINE {
		return p, invalid("unknown operation kind", "unknown operation kind")
	}
	return p, nil
}

func mac(key, data []byte) []byte {
	h := hmac.New(sha256.New, key)
	h.Write(data)
	return h.Sum(nil)
}

// loadKeys reads the token keys: one per line, the first seals, all verify; blank lines and
// lines starting with '#' are skipped, surrounding whitespace is ignored. Each key must be at
// least 16 bytes. Without a file, dev mode makes a random key (tokens then do not survive a
// restart, which is fine for an in-memory cloud that does not either).
func loadKeys(file string, dev bool) (keys [][]byte, random bool, err error) {
	if file == "" {
		if !dev {
			return nil, false, errors.New("no operation token key: pass --token-key-file FILE (or set DRIVER_TOKEN_KEY_FILE), or --dev for a random key")
		}
		k := make([]byte, 32)
		_, _ = rand.Read(k)
		return [][]byte{k}, true, nil
	}
	text, err := os.ReadFile(file)
	if err != nil {
		return nil, false, fmt.Errorf("reading token key file: %w", err)
	}
	for i, line := range strings.Split(string(text), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if len(line) < minKeyLen {
			// Say which line, never what it holds.
			return nil, false, fmt.Errorf("token key file %s, line %d: a key must be at least %d bytes, this one has %d", file, i+1, minKeyLen, len(line))
		}
		keys = append(keys, []byte(line))
	}
	if len(keys) == 0 {
		return nil, false, fmt.Errorf("token key file %s holds no key", file)
	}
	return keys, false, nil
}
