// Package promtest reads metrics back from a Prometheus registry in tests.
package promtest

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
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

// WithText is g together with the families write writes in the text
// format (a daemon's metrics.WriteText), parsed back as Prometheus would
// parse them: a text that does not parse fails the Gather.
func WithText(g prometheus.Gatherer, write func(io.Writer) error) prometheus.Gatherer {
	text := prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		var text bytes.Buffer
		if err := write(&text); err != nil {
			return nil, fmt.Errorf("writing the text families: %w", err)
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		parsed, err := parser.TextToMetricFamilies(&text)
		if err != nil {
			return nil, fmt.Errorf("parsing the text families: %w", err)
		}
		out := make([]*dto.MetricFamily, 0, len(parsed))
		for _, f := range parsed {
			out = append(out, f)
		}
		return out, nil
	})
	// First, as the daemons serve them (see daemon.MetricsHandler).
	return prometheus.Gatherers{text, g}
}
