// Package flagenv gives every command-line flag an environment variable
// fallback, so that a DaemonSet can take its configuration from a ConfigMap
// (envFrom) while a flag on the command line still wins.
package flagenv

import (
	"flag"
	"fmt"
	"os"
	"strings"
)

// Name returns the environment variable of a flag: prefix + the flag name in
// upper case with dashes turned into underscores (seed -> KST_SEED).
func Name(prefix, flagName string) string {
	return prefix + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Apply sets every flag of fs that was not given on the command line from its
// environment variable, if that is set. Call it after fs.Parse.
func Apply(fs *flag.FlagSet, prefix string) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] || err != nil {
			return
		}
		env := Name(prefix, f.Name)
		if v, ok := os.LookupEnv(env); ok {
			if e := fs.Set(f.Name, v); e != nil {
				err = fmt.Errorf("environment variable %s=%q (flag --%s): %w", env, v, f.Name, e)
			}
		}
	})
	return err
}
