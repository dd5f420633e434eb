package tunnelclaim

import (
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Compare orders Services claiming the same tunnel IP, the winner first: the
// oldest by creationTimestamp, then by namespace/name. Every router and every
// endpoint agent decides with this one function, so they all agree.
func Compare(a, b *corev1.Service) int {
	if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
		if a.CreationTimestamp.Before(&b.CreationTimestamp) {
			return -1
		}
		return 1
	}
	return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
}

// Sort orders claimants of one tunnel IP with Compare, the winner first.
func Sort(claimants []*corev1.Service) { slices.SortFunc(claimants, Compare) }
