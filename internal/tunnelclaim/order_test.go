package tunnelclaim

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestSortOldestThenName(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	svc := func(ns, name string, age time.Duration) *corev1.Service {
		return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, CreationTimestamp: metav1.NewTime(t0.Add(-age))}}
	}
	got := []*corev1.Service{svc("b", "x", time.Hour), svc("a", "z", time.Hour), svc("c", "old", 2*time.Hour), svc("a", "new", 0)}
	Sort(got)
	var names []string
	for _, s := range got {
		names = append(names, s.Namespace+"/"+s.Name)
	}
	want := []string{"c/old", "a/z", "b/x", "a/new"}
	for i := range want {
		if names[i] != want[i] {
			t.Fatalf("order = %v, want %v", names, want)
		}
	}
}
