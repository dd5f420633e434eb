package daemon

import (
	"context"
	"errors"
	"flag"
	"os/signal"
	"syscall"

	"github.com/sirupsen/logrus"
)

// Options is what Start asks of a daemon's options.
type Options interface {
	AddFlags(fs *flag.FlagSet)
	Parse(fs *flag.FlagSet, args []string) error
	Logger(component string) (*logrus.Entry, error)
}

// Start is how every daemon begins: first of all it takes SIGINT and SIGTERM
// (a rollout or a quick restart during the start must stop the daemon
// cleanly, not kill it mid-way), then parses args into o and builds the
// logger. ctx ends at the first signal; call stop when the daemon returns.
// help is true when args asked for -h, which was printed: the daemon then
// returns nil.
func Start(name string, o Options, args []string) (ctx context.Context, stop context.CancelFunc, log *logrus.Entry, help bool, err error) {
	ctx, stop = signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	o.AddFlags(fs)
	if err := o.Parse(fs, args); err != nil {
		stop()
		if errors.Is(err, flag.ErrHelp) {
			return nil, nil, nil, true, nil
		}
		return nil, nil, nil, false, err
	}
	if log, err = o.Logger(name); err != nil {
		stop()
		return nil, nil, nil, false, err
	}
	return ctx, stop, log, false, nil
}
