package kubeenv

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
)

const (
	// ApplyFieldManager is the field manager of ApplyYAML's server-side applies.
	ApplyFieldManager = "kubeenv"
	// mappingTimeout bounds the wait for a kind that discovery does not know
	// yet, e.g. a custom resource whose CRD an earlier document created.
	mappingTimeout = 15 * time.Second
)

// ApplyYAML applies every object of a multi-document YAML or JSON manifest
// (List kinds are expanded) with server-side apply (field manager "kubeenv",
// conflicts forced), authenticating with cfg (AdminConfig when nil).
// Namespaces and CustomResourceDefinitions go first, everything else in
// document order; namespaced objects without a namespace go to "default".
// With dryRun every request is DryRun=All, so nothing is persisted: objects
// in a namespace, or of a CRD, that the same manifest would create fail.
// It stops at the first error.
func (e *Env) ApplyYAML(ctx context.Context, cfg *rest.Config, yamlBytes []byte, dryRun bool) error {
	if cfg == nil {
		cfg = e.AdminConfig()
	}
	return Apply(ctx, cfg, yamlBytes, dryRun)
}

// Apply is ApplyYAML for any API server cfg names (a kubelet node's guest
// program has no Env).
func Apply(ctx context.Context, cfg *rest.Config, yamlBytes []byte, dryRun bool) error {
	objs, err := decodeManifest(yamlBytes)
	if err != nil {
		return err
	}
	a, err := newApplier(cfg, dryRun)
	if err != nil {
		return err
	}
	for _, obj := range orderForApply(objs) {
		if err := a.apply(ctx, obj); err != nil {
			return err
		}
	}
	return nil
}

// decodeManifest splits a manifest into objects, skipping empty documents.
func decodeManifest(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var objs []*unstructured.Unstructured
	for doc := 1; ; doc++ {
		var raw json.RawMessage
		err := dec.Decode(&raw)
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("manifest document %d: %w", doc, err)
		}
		docObjs, err := decodeObject(raw)
		if err != nil {
			return nil, fmt.Errorf("manifest document %d: %w", doc, err)
		}
		objs = append(objs, docObjs...)
	}
}

// decodeObject decodes one JSON document into objects (several for a List).
func decodeObject(raw json.RawMessage) ([]*unstructured.Unstructured, error) {
	trimmed := bytes.TrimSpace(raw)
	if len(trimmed) == 0 || bytes.Equal(trimmed, []byte("null")) || bytes.Equal(trimmed, []byte("{}")) {
		return nil, nil
	}
	obj, _, err := unstructured.UnstructuredJSONScheme.Decode(trimmed, nil, nil)
	if err != nil {
		return nil, fmt.Errorf("decode object: %w", err)
	}
	switch o := obj.(type) {
	case *unstructured.Unstructured:
		return []*unstructured.Unstructured{o}, nil
	case *unstructured.UnstructuredList:
		objs := make([]*unstructured.Unstructured, 0, len(o.Items))
		for i := range o.Items {
			objs = append(objs, &o.Items[i])
		}
		return objs, nil
	default:
		return nil, fmt.Errorf("decode object: unexpected type %T", obj)
	}
}

// orderForApply moves Namespaces, then CustomResourceDefinitions, to the
// front, keeping the document order otherwise.
func orderForApply(objs []*unstructured.Unstructured) []*unstructured.Unstructured {
	rank := func(u *unstructured.Unstructured) int {
		switch u.GroupVersionKind().GroupKind() {
		case schema.GroupKind{Kind: "Namespace"}:
			return 0
		case schema.GroupKind{Group: "apiextensions.k8s.io", Kind: "CustomResourceDefinition"}:
			return 1
		default:
			return 2
		}
	}
	sorted := slices.Clone(objs)
	slices.SortStableFunc(sorted, func(a, b *unstructured.Unstructured) int { return rank(a) - rank(b) })
	return sorted
}

// applier server-side applies objects through a dynamic client.
type applier struct {
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
	opts   metav1.ApplyOptions
	dryRun bool
}

func newApplier(cfg *rest.Config, dryRun bool) (*applier, error) {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("discovery client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("dynamic client: %w", err)
	}
	opts := metav1.ApplyOptions{FieldManager: ApplyFieldManager, Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	return &applier{
		dyn:    dyn,
		mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc)),
		opts:   opts,
		dryRun: dryRun,
	}, nil
}

// apply server-side applies one object.
func (a *applier) apply(ctx context.Context, u *unstructured.Unstructured) error {
	res, err := a.resource(ctx, u)
	if err != nil {
		return fmt.Errorf("apply %w", err)
	}
	if _, err := res.Apply(ctx, u.GetName(), u, a.opts); err != nil {
		return fmt.Errorf("apply %s %s: %w", u.GetKind(), objectKey(u), err)
	}
	return nil
}

// Delete deletes every object of a manifest, as kubectl delete -f does, in
// the reverse of Apply's order (Namespaces last), with background
// propagation; objects already gone are not an error. It does not wait for
// the objects to disappear.
func Delete(ctx context.Context, cfg *rest.Config, yamlBytes []byte) error {
	objs, err := decodeManifest(yamlBytes)
	if err != nil {
		return err
	}
	a, err := newApplier(cfg, false)
	if err != nil {
		return err
	}
	ordered := orderForApply(objs)
	policy := metav1.DeletePropagationBackground
	for i := len(ordered) - 1; i >= 0; i-- {
		u := ordered[i]
		res, err := a.resource(ctx, u)
		if err != nil {
			return err
		}
		if err := res.Delete(ctx, u.GetName(), metav1.DeleteOptions{PropagationPolicy: &policy}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete %s %s: %w", u.GetKind(), objectKey(u), err)
		}
	}
	return nil
}

// resource is the client of u's resource, in u's namespace (default when
// it names none) for namespaced kinds.
func (a *applier) resource(ctx context.Context, u *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := u.GroupVersionKind()
	if u.GetName() == "" {
		return nil, fmt.Errorf("%s: object has no metadata.name", gvk.Kind)
	}
	mapping, err := a.mapping(ctx, gvk)
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w", gvk.Kind, u.GetName(), err)
	}
	if mapping.Scope.Name() != meta.RESTScopeNameNamespace {
		return a.dyn.Resource(mapping.Resource), nil
	}
	if u.GetNamespace() == "" {
		u.SetNamespace(metav1.NamespaceDefault)
	}
	return a.dyn.Resource(mapping.Resource).Namespace(u.GetNamespace()), nil
}

// mapping finds the resource for gvk. An unknown kind refreshes discovery
// and, unless dry-running, is retried for mappingTimeout (a CRD applied just
// before takes a moment to be served).
func (a *applier) mapping(ctx context.Context, gvk schema.GroupVersionKind) (*meta.RESTMapping, error) {
	deadline := time.Now().Add(mappingTimeout)
	for refreshed := false; ; refreshed = true {
		m, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err == nil {
			return m, nil
		}
		if !meta.IsNoMatchError(err) || (refreshed && (a.dryRun || time.Now().After(deadline))) {
			return nil, fmt.Errorf("map %s: %w", gvk, err)
		}
		a.mapper.Reset()
		if refreshed {
			if err := sleepCtx(ctx, 250*time.Millisecond); err != nil {
				return nil, fmt.Errorf("map %s: %w", gvk, err)
			}
		}
	}
}

// objectKey returns NAMESPACE/NAME, or NAME for cluster-scoped objects.
func objectKey(u *unstructured.Unstructured) string {
	if u.GetNamespace() == "" {
		return u.GetName()
	}
	return u.GetNamespace() + "/" + u.GetName()
}

// sleepCtx sleeps for d or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
