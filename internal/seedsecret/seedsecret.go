// Package seedsecret keeps the cluster's HMARK seed in a Secret: the routers
// read it at start-up, the first one to start in a cluster without one
// creates it with a random seed, and whoever the operator grants can read it
// to predict where a flow goes (kubectl tunnel explain).
//
// The seed decides the bucket of every flow, so it is a secret of the
// cluster: a client that knows it can aim its flows at a chosen bucket. No
// default seed ships; each cluster gets its own.
package seedsecret

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// Defaults: the Secret the manifest's RBAC grants the routers.
const (
	DefaultNamespace = "kube-service-tunnel"
	DefaultName      = "tunnel-hmark-seed"
	// Key is the Secret's data key holding the seed, decimal or 0x-hex.
	Key = "seed"
)

// Ref names a seed Secret.
type Ref struct{ Namespace, Name string }

func (r Ref) String() string { return r.Namespace + "/" + r.Name }

// Parse reads the seed out of a Secret, naming the Secret and the key in
// its error.
func Parse(s *corev1.Secret) (uint32, error) {
	raw, ok := s.Data[Key]
	if !ok {
		return 0, fmt.Errorf("secret %s/%s has no data key %q", s.Namespace, s.Name, Key)
	}
	v, err := ParseSeed(strings.TrimSpace(string(raw)))
	if err != nil {
		return 0, fmt.Errorf("secret %s/%s, data key %q: %w", s.Namespace, s.Name, Key, err)
	}
	return v, nil
}

// ParseSeed parses a seed written as a 32-bit number, decimal or 0x-hex.
func ParseSeed(s string) (uint32, error) {
	v, err := strconv.ParseUint(s, 0, 32)
	if err != nil {
		return 0, fmt.Errorf("seed %q: must be a 32-bit number, decimal or 0x-hex", s)
	}
	return uint32(v), nil
}

// Format writes a seed as the Secret holds it.
func Format(seed uint32) string { return fmt.Sprintf("%#08x", seed) }

// Read returns the seed in the Secret ref.
func Read(ctx context.Context, client kubernetes.Interface, ref Ref) (uint32, error) {
	s, err := client.CoreV1().Secrets(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	if err != nil {
		return 0, fmt.Errorf("reading the HMARK seed from secret %s: %w", ref, err)
	}
	return Parse(s)
}

// Source says where Ensure's seed came from.
type Source string

const (
	// Existing: the Secret was there (an operator's seed, or one a router
	// created earlier).
	Existing Source = "existing"
	// Created: this call created the Secret with a random seed.
	Created Source = "created"
)

// Ensure returns the seed in the Secret ref, creating the Secret with a
// random seed when there is none. Routers starting at once agree: only one
// create succeeds, and every other reads what it wrote. Errors that may pass
// (the API server not answering yet, a conflict) are retried until timeout;
// a Secret without a valid seed, or a Forbidden answer, is returned at once.
func Ensure(ctx context.Context, client kubernetes.Interface, ref Ref, timeout time.Duration) (seed uint32, source Source, err error) {
	var last error
	poll := wait.Backoff{Duration: 200 * time.Millisecond, Factor: 2, Jitter: 0.2, Steps: 1 << 30, Cap: 5 * time.Second}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err = wait.ExponentialBackoffWithContext(ctx, poll, func(ctx context.Context) (bool, error) {
		seed, source, last = ensureOnce(ctx, client, ref)
		switch {
		case last == nil:
			return true, nil
		case apierrors.IsForbidden(last) || apierrors.IsUnauthorized(last) || errors.Is(last, errInvalid):
			return false, last
		}
		return false, nil
	})
	if err != nil {
		if last != nil && !errors.Is(err, last) {
			err = fmt.Errorf("%w (last error: %w)", err, last)
		}
		return 0, "", err
	}
	return seed, source, nil
}

var errInvalid = errors.New("invalid seed secret")

func ensureOnce(ctx context.Context, client kubernetes.Interface, ref Ref) (uint32, Source, error) {
	secrets := client.CoreV1().Secrets(ref.Namespace)
	s, err := secrets.Get(ctx, ref.Name, metav1.GetOptions{})
	if err == nil {
		seed, err := Parse(s)
		if err != nil {
			return 0, "", fmt.Errorf("%w: %w", errInvalid, err)
		}
		return seed, Existing, nil
	}
	if !apierrors.IsNotFound(err) {
		return 0, "", fmt.Errorf("reading secret %s: %w", ref, err)
	}
	seed, err := Random()
	if err != nil {
		return 0, "", err
	}
	_, err = secrets.Create(ctx, New(ref, seed), metav1.CreateOptions{})
	if err != nil {
		// AlreadyExists: another router won; the next try reads its seed.
		return 0, "", fmt.Errorf("creating secret %s: %w", ref, err)
	}
	return seed, Created, nil
}

// New returns the Secret ref holding seed.
func New(ref Ref, seed uint32) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ref.Namespace, Name: ref.Name,
			Labels: map[string]string{"app.kubernetes.io/part-of": "kube-service-tunnel"},
			Annotations: map[string]string{
				"cmd.nu/tunnel-seed": "the HMARK seed of every tunnel router; changing it moves every flow to a new bucket: restart all routers at once after an edit",
			},
		},
		Type: corev1.SecretTypeOpaque,
		Data: map[string][]byte{Key: []byte(Format(seed))},
	}
}

// Random returns a seed from the system's random source.
func Random() (uint32, error) {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, fmt.Errorf("random seed: %w", err)
	}
	return binary.BigEndian.Uint32(b[:]), nil
}
