package daemon

import (
	"compress/gzip"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/sirupsen/logrus"
)

// TextWriter writes metric families straight in the Prometheus text
// exposition format (version 0.0.4), none of them a family of the
// registry it is served with. A daemon uses it for families of one series
// per tunnel IP or endpoint: client_golang's registry builds two objects
// per series at every scrape, which at 100,000 series is about 100 MB of
// garbage per scrape (see the router's metrics.WriteText).
type TextWriter func(w io.Writer) error

// textFormat is the exposition format /metrics serves.
var textFormat = expfmt.NewFormat(expfmt.TypeTextPlain)

var gzipWriters = sync.Pool{New: func() any { return gzip.NewWriter(nil) }}

// MetricsHandler serves stream's families (nil: none), then reg's, in the
// text format, gzipped when the scraper accepts it (Prometheus does).
// stream goes first so that a collector of reg that counts stream's
// errors shows this scrape's. A write that fails (the scraper went away)
// ends the response and is logged.
func MetricsHandler(reg prometheus.Gatherer, stream TextWriter, log logrus.FieldLogger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", string(textFormat))
		var out io.Writer = w
		if acceptsGzip(r.Header.Get("Accept-Encoding")) {
			w.Header().Set("Content-Encoding", "gzip")
			gz := gzipWriters.Get().(*gzip.Writer)
			gz.Reset(w)
			defer func() {
				if err := gz.Close(); err != nil {
					log.WithError(err).Debug("metrics scrape: finishing the gzip stream")
				}
				gzipWriters.Put(gz)
			}()
			out = gz
		}
		if stream != nil {
			if err := stream(out); err != nil {
				log.WithError(err).Warn("metrics scrape: writing the per tunnel IP families")
				return
			}
		}
		families, err := reg.Gather()
		if err != nil {
			// Gather returns what it could gather with the error.
			log.WithError(err).Warn("metrics scrape: gathering the registry")
		}
		enc := expfmt.NewEncoder(out, textFormat)
		for _, f := range families {
			if err := enc.Encode(f); err != nil {
				log.WithError(err).Debug("metrics scrape: writing a family")
				return
			}
		}
	})
}

// acceptsGzip reports whether an Accept-Encoding header lists gzip with a
// non-zero quality.
func acceptsGzip(header string) bool {
	for _, part := range strings.Split(header, ",") {
		coding, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.TrimSpace(coding) != "gzip" {
			continue
		}
		q := strings.ReplaceAll(params, " ", "")
		return q != "q=0" && q != "q=0.0" && q != "q=0.00" && q != "q=0.000"
	}
	return false
}
