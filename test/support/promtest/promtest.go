// Package promtest reads metrics back from a Prometheus registry in tests.
package promtest

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Series gathers g and returns the values of the metric family name by
// their labels, rendered "k=v,k=v" in label-name order ("" without labels):
// a counter's or gauge's value, a histogram's sample count.
func Series(t testing.TB, g prometheus.Gatherer, name string) map[string]float64 {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			out[strings.Join(labels, ",")] = Value(f.GetType(), m)
		}
	}
	return out
}

// Value is a counter's or gauge's value, or a histogram's sample count.
func Value(typ dto.MetricType, m *dto.Metric) float64 {
	switch typ {
	case dto.MetricType_COUNTER:
		return m.GetCounter().GetValue()
	case dto.MetricType_GAUGE:
		return m.GetGauge().GetValue()
	case dto.MetricType_HISTOGRAM:
		return float64(m.GetHistogram().GetSampleCount())
	}
	return m.GetUntyped().GetValue()
}
