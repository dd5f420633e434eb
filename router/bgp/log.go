package bgp

import (
	"context"
	"log/slog"

	"github.com/sirupsen/logrus"
)

// gobgpLogger hands GoBGP's structured logs to the router's logger, at
// warning level and above (GoBGP logs every FSM step at info).
func gobgpLogger(log logrus.FieldLogger) (*slog.Logger, *slog.LevelVar) {
	level := &slog.LevelVar{}
	level.Set(slog.LevelWarn)
	return slog.New(&logrusHandler{log: log.WithField("component", "gobgp"), level: level}), level
}

type logrusHandler struct {
	log   logrus.FieldLogger
	level *slog.LevelVar
}

func (h *logrusHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= h.level.Level() }

func (h *logrusHandler) Handle(_ context.Context, r slog.Record) error {
	fields := logrus.Fields{}
	r.Attrs(func(a slog.Attr) bool {
		fields[a.Key] = a.Value.String()
		return true
	})
	entry := h.log.WithFields(fields)
	switch {
	case r.Level >= slog.LevelError:
		entry.Error(r.Message)
	case r.Level >= slog.LevelWarn:
		entry.Warn(r.Message)
	case r.Level >= slog.LevelInfo:
		entry.Info(r.Message)
	default:
		entry.Debug(r.Message)
	}
	return nil
}

func (h *logrusHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	fields := logrus.Fields{}
	for _, a := range attrs {
		fields[a.Key] = a.Value.String()
	}
	return &logrusHandler{log: h.log.WithFields(fields), level: h.level}
}

// WithGroup flattens groups: GoBGP does not use them for anything an
// operator reads.
func (h *logrusHandler) WithGroup(string) slog.Handler { return h }
