package kubeobj

import (
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// EndpointSlice is what both daemons keep of a discovery/v1 EndpointSlice:
// the informers' transform (SlimEndpointSlice) stores this type, not the
// API's, because the slices are most of a daemon's cache in a large cluster
// (100,000 endpoints) and an API Endpoint with its targetRef takes ~400
// bytes where this one takes ~200. It keeps the slice's identity, its
// Service, its address type, and of each endpoint what the daemons read.
// No one writes to a cached slice.
type EndpointSlice struct {
	metav1.ObjectMeta
	// Service is the name of the slice's Service (its
	// kubernetes.io/service-name label; "" without one).
	Service     string
	AddressType discoveryv1.AddressType
	Endpoints   []Endpoint
}

// Endpoint is what the daemons read of an EndpointSlice endpoint.
type Endpoint struct {
	// Address is the first of the endpoint's addresses ("" when it has
	// none): the API lets consumers use the first alone.
	Address string
	// NodeName is the endpoint's node ("" when not given).
	NodeName string
	// Pod is the Pod its targetRef names (IsZero when it names none); a
	// targetRef without a namespace means the slice's.
	Pod PodRef
	// Conditions are the endpoint's ready and serving conditions, each
	// true, false or unset (the daemons read no other).
	Conditions Conditions
}

// Conditions packs an endpoint's ready and serving conditions, each true,
// false or unset (nil in the API).
type Conditions uint8

const (
	readySet Conditions = 1 << iota
	ready
	servingSet
	serving
)

// NewConditions packs the API's conditions.
func NewConditions(c discoveryv1.EndpointConditions) Conditions {
	var out Conditions
	for _, cond := range []struct {
		value         *bool
		set, trueFlag Conditions
	}{{c.Ready, readySet, ready}, {c.Serving, servingSet, serving}} {
		if cond.value != nil {
			out |= cond.set
			if *cond.value {
				out |= cond.trueFlag
			}
		}
	}
	return out
}

// Ready is the ready condition and whether it is set.
func (c Conditions) Ready() (value, set bool) { return c&ready != 0, c&readySet != 0 }

// Serving is the serving condition and whether it is set.
func (c Conditions) Serving() (value, set bool) { return c&serving != 0, c&servingSet != 0 }

// NewEndpointSlice is what the daemons keep of es (see EndpointSlice).
// Namespaces, node names and address types share their bytes across slices.
func NewEndpointSlice(es *discoveryv1.EndpointSlice) *EndpointSlice {
	out := &EndpointSlice{
		ObjectMeta:  slimMeta(es.ObjectMeta),
		Service:     es.Labels[discoveryv1.LabelServiceName],
		AddressType: discoveryv1.AddressType(sharedStrings.intern(string(es.AddressType))),
		Endpoints:   make([]Endpoint, len(es.Endpoints)),
	}
	for i, ep := range es.Endpoints {
		e := &out.Endpoints[i]
		if len(ep.Addresses) > 0 {
			e.Address = ep.Addresses[0]
		}
		if ep.NodeName != nil {
			e.NodeName = sharedStrings.intern(*ep.NodeName)
		}
		if ref := ep.TargetRef; ref != nil && ref.Kind == "Pod" {
			ns := ref.Namespace
			if ns == "" {
				ns = es.Namespace
			}
			e.Pod = PodRef{Namespace: sharedStrings.intern(ns), Name: ref.Name, UID: string(ref.UID)}
		}
		e.Conditions = NewConditions(ep.Conditions)
	}
	return out
}

// GetObjectKind makes EndpointSlice a runtime.Object (the informer's store
// holds it): it carries no type metadata.
func (es *EndpointSlice) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// DeepCopyObject copies es.
func (es *EndpointSlice) DeepCopyObject() runtime.Object {
	out := *es
	es.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	out.Endpoints = append([]Endpoint(nil), es.Endpoints...)
	return &out
}

// EndpointSlices picks the *EndpointSlice among objs (a store's list).
func EndpointSlices(objs []any) []*EndpointSlice {
	out := make([]*EndpointSlice, 0, len(objs))
	for _, obj := range objs {
		if es, ok := obj.(*EndpointSlice); ok {
			out = append(out, es)
		}
	}
	return out
}
