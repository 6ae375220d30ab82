# Sourced by the recipes after they set their defaults (icefall style):
#   --some-name value  or  --some-name=value  sets $some_name.
# Usage: options="stage stop_stage python ..."; . "$(dirname "$0")/../parse_options.sh"
# Only the names listed in $options are accepted, so a typo is an error, not a silent no-op.
while [ $# -gt 0 ]; do
  case "$1" in
    --*=*) name=${1%%=*}; value=${1#*=}; shift ;;
    --*) name=$1; value=${2:?"$1 needs a value"}; shift 2 ;;
    *) echo "$0: unexpected argument $1" >&2; exit 1 ;;
  esac
  name=${name#--}; name=${name//-/_}
  case " $options " in
    *" $name "*) printf -v "$name" '%s' "$value" ;;
    *) echo "$0: unknown option --${name//_/-} (known: ${options})" >&2; exit 1 ;;
  esac
done
