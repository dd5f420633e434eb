package daemon

import (
	"compress/gzip"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/sirupsen/logrus"
)

// /metrics serves the streamed families first, then the registry's, as one
// text that Prometheus parses, gzipped when asked.
func TestMetricsHandler(t *testing.T) {
	reg := prometheus.NewRegistry()
	scrapes := prometheus.NewCounter(prometheus.CounterOpts{Name: "test_stream_writes_total", Help: "Writes of the streamed families."})
	reg.MustRegister(scrapes)
	stream := func(w io.Writer) error {
		scrapes.Inc() // the registry, written after, shows this scrape
		_, err := fmt.Fprint(w, "# HELP test_per_vip Per tunnel IP.\n# TYPE test_per_vip gauge\ntest_per_vip{vip=\"192.0.2.1\"} 3\n")
		return err
	}
	log := logrus.New()
	log.Out = io.Discard
	srv := httptest.NewServer(MetricsHandler(reg, stream, log))
	t.Cleanup(srv.Close)

	for _, gz := range []bool{false, true} {
		req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
		if err != nil {
			t.Fatal(err)
		}
		// Set explicitly, the transport leaves the body compressed.
		req.Header.Set("Accept-Encoding", map[bool]string{false: "identity", true: "gzip"}[gz])
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := io.Reader(resp.Body)
		if got := resp.Header.Get("Content-Encoding") == "gzip"; got != gz {
			t.Fatalf("gzip asked %v, Content-Encoding %q", gz, resp.Header.Get("Content-Encoding"))
		}
		if gz {
			if body, err = gzip.NewReader(resp.Body); err != nil {
				t.Fatal(err)
			}
		}
		text, err := io.ReadAll(body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain; version=0.0.4") {
			t.Errorf("Content-Type %q, want the text format 0.0.4", ct)
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		families, err := parser.TextToMetricFamilies(strings.NewReader(string(text)))
		if err != nil {
			t.Fatalf("gzip %v: /metrics does not parse: %v\n%s", gz, err, text)
		}
		if v := families["test_per_vip"].GetMetric()[0].GetGauge().GetValue(); v != 3 {
			t.Errorf("streamed family value %v, want 3", v)
		}
		want := map[bool]float64{false: 1, true: 2}[gz]
		if v := families["test_stream_writes_total"].GetMetric()[0].GetCounter().GetValue(); v != want {
			t.Errorf("registry counter %v, want %v (the stream goes first)", v, want)
		}
	}
}

func TestAcceptsGzip(t *testing.T) {
	for header, want := range map[string]bool{
		"gzip": true, "identity": false, "": false, "deflate, gzip;q=0.5": true,
		"gzip;q=0": false, "br, gzip ; q=0.0": false, "x-gzip": false,
	} {
		if got := acceptsGzip(header); got != want {
			t.Errorf("acceptsGzip(%q) = %v, want %v", header, got, want)
		}
	}
}
