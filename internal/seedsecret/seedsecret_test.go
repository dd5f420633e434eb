package seedsecret

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

var ref = Ref{Namespace: DefaultNamespace, Name: DefaultName}

func TestParseSeed(t *testing.T) {
	for in, want := range map[string]uint32{"0x5eed1e55": 0x5eed1e55, "42": 42, "0xffffffff": 0xffffffff} {
		if got, err := ParseSeed(in); err != nil || got != want {
			t.Errorf("ParseSeed(%q) = %#x, %v; want %#x", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0x100000000", "-1", "seed"} {
		if _, err := ParseSeed(in); err == nil {
			t.Errorf("ParseSeed(%q) accepted", in)
		}
	}
	if got, _ := ParseSeed(Format(0x2a)); got != 0x2a {
		t.Errorf("Format does not parse back: %q", Format(0x2a))
	}
}

func TestEnsureCreatesOnceThenReads(t *testing.T) {
	client := fake.NewClientset()
	seed, source, err := Ensure(context.Background(), client, ref, time.Second)
	if err != nil || source != Created {
		t.Fatalf("first Ensure: %v, source %s", err, source)
	}
	again, source, err := Ensure(context.Background(), client, ref, time.Second)
	if err != nil || source != Existing || again != seed {
		t.Fatalf("second Ensure: %#x from %s (%v), want %#x from the Secret", again, source, err, seed)
	}
	s, err := client.CoreV1().Secrets(ref.Namespace).Get(context.Background(), ref.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := Parse(s); err != nil || got != seed {
		t.Errorf("the Secret holds %#x (%v), Ensure returned %#x", got, err, seed)
	}
}

func TestEnsureKeepsOperatorSeed(t *testing.T) {
	client := fake.NewClientset(New(ref, 0x1234))
	seed, source, err := Ensure(context.Background(), client, ref, time.Second)
	if err != nil || seed != 0x1234 || source != Existing {
		t.Fatalf("Ensure = %#x from %s, %v; want the operator's 0x1234", seed, source, err)
	}
}

// Two routers starting at once: both read NotFound before either creates;
// one create loses with AlreadyExists and that router reads the winner's
// seed. (The fake's reactors run under its lock, so the interleaving is
// forced by answering the first two reads NotFound.)
func TestEnsureConcurrentAgree(t *testing.T) {
	client := fake.NewClientset()
	var mu sync.Mutex
	gets := 0
	client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		if gets++; gets <= 2 {
			return true, nil, apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, ref.Name)
		}
		return false, nil, nil
	})
	seeds := make([]uint32, 2)
	sources := make([]Source, 2)
	var wg sync.WaitGroup
	for i := range seeds {
		wg.Go(func() {
			var err error
			seeds[i], sources[i], err = Ensure(context.Background(), client, ref, 10*time.Second)
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if seeds[0] != seeds[1] {
		t.Errorf("routers starting at once chose %#x and %#x", seeds[0], seeds[1])
	}
	if (sources[0] == Created) == (sources[1] == Created) {
		t.Errorf("sources %v: exactly one router must create the Secret", sources)
	}
}

func TestEnsureBadSecretFailsAtOnce(t *testing.T) {
	bad := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ref.Namespace, Name: ref.Name}, Data: map[string][]byte{Key: []byte("not a number")}}
	client := fake.NewClientset(bad)
	start := time.Now()
	_, _, err := Ensure(context.Background(), client, ref, time.Minute)
	if err == nil || !strings.Contains(err.Error(), ref.String()) || !strings.Contains(err.Error(), `"seed"`) {
		t.Fatalf("Ensure of a bad Secret: %v; want an error naming the Secret and its key", err)
	}
	if time.Since(start) > 30*time.Second {
		t.Errorf("a bad Secret was retried until the timeout")
	}
	noKey := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ref.Namespace, Name: ref.Name}}
	if _, err := Parse(noKey); err == nil || !strings.Contains(err.Error(), "no data key") {
		t.Errorf("Parse without the key: %v", err)
	}
}

func TestEnsureForbiddenFailsAtOnce(t *testing.T) {
	client := fake.NewClientset()
	client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, ref.Name, errors.New("no RBAC"))
	})
	_, _, err := Ensure(context.Background(), client, ref, time.Minute)
	if !apierrors.IsForbidden(err) {
		t.Fatalf("Ensure when forbidden: %v", err)
	}
}

func TestEnsureRetriesUntilTimeout(t *testing.T) {
	client := fake.NewClientset()
	calls := 0
	client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		calls++
		if calls < 3 {
			return true, nil, apierrors.NewServiceUnavailable("starting")
		}
		return false, nil, nil
	})
	if _, source, err := Ensure(context.Background(), client, ref, 30*time.Second); err != nil || source != Created {
		t.Fatalf("Ensure after an unavailable API server: %s, %v", source, err)
	}
	client = fake.NewClientset()
	client.PrependReactor("get", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("down")
	})
	_, _, err := Ensure(context.Background(), client, ref, 500*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "down") {
		t.Fatalf("Ensure against a down API server: %v; want its last error", err)
	}
}
