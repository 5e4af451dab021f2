use super::*;

const ENTRY: &str = "verl.trainer.main_ppo";

/// The launch of `script` with `$HOME=/home/u`, `$(pwd)` = /work, and `extra` set in the
/// environment.
fn read(script: &str, extra: &[(&str, &str)]) -> Launch {
    read_with(script, extra, &[])
}

/// [`read`] with the script's arguments.
fn read_with(script: &str, extra: &[(&str, &str)], script_args: &[String]) -> Launch {
    let lookup = |name: &str| match name {
        "HOME" => Some("/home/u".to_owned()),
        _ => extra
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string()),
    };
    let env = Env {
        var: &lookup,
        cwd: Some("/work".into()),
        args: script_args,
    };
    launch(script, env, &|w| w == ENTRY)
        .unwrap()
        .unwrap_or_else(|| panic!("no launch in {script}"))
}

/// The arguments as text; an unread one as `!raw: why`.
fn args(l: &Launch) -> Vec<String> {
    l.args
        .iter()
        .map(|a| match a {
            Arg::Text { text, .. } => text.clone(),
            Arg::Unread { raw, why } => format!("!{raw}: {why}"),
        })
        .collect()
}

#[test]
fn a_gsm8k_script_s_variables_and_quoted_lists_expand() {
    let l = read(
        "#!/usr/bin/env bash\nset -x\n\
         gsm8k_train_path=$HOME/data/gsm8k/train.parquet\n\
         math_train_path=~/data/math/train.parquet\n\
         train_files=\"['$gsm8k_train_path', '$math_train_path']\"\n\
         export MODEL=${MODEL:-Qwen/Qwen2-7B}; max_prompt_length=$((1024 * 2))\n\
         python3 -m verl.trainer.main_ppo \\\n    data.train_files=\"$train_files\" \\\n    \
         actor_rollout_ref.model.path=$MODEL \\\n    \
         data.max_prompt_length=${max_prompt_length} \\\n    \
         actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(((max_prompt_length + 1024) * 2)) \\\n    \
         trainer.logger='[\"console\"]' \"$@\" 2>&1 | tee log.txt\n",
        &[],
    );
    assert_eq!(
        args(&l),
        [
            "data.train_files=['/home/u/data/gsm8k/train.parquet', '/home/u/data/math/train.parquet']",
            "actor_rollout_ref.model.path=Qwen/Qwen2-7B",
            "data.max_prompt_length=2048",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6144",
            "trainer.logger=[\"console\"]",
        ]
    );
    assert_eq!(l.entry, ENTRY);
    assert!(l.conditional.is_none());
    // where a word was expanded, the word it came from is kept; a plain one has none
    assert!(
        matches!(&l.args[1], Arg::Text { from: Some(f), .. } if f == "actor_rollout_ref.model.path=$MODEL")
    );
    assert!(matches!(&l.args[4], Arg::Text { from: Some(_), .. }));
    // the environment wins over a default
    let l = read(
        "M=${MODEL:-a}\npython3 -m verl.trainer.main_ppo m=$M\n",
        &[("MODEL", "b")],
    );
    assert_eq!(args(&l), ["m=b"]);
}

#[test]
fn arrays_and_unquoted_strings_give_one_argument_per_element_or_word() {
    let l = read(
        "DATA=(\n    data.train_files=\"$HOME/t.parquet\"  # train\n    data.shuffle=False\n)\n\
         DATA+=(data.seed=1)\nEXTRA=\"a=1 b=2\"\nQUOTED=\"c=1 d=2\"\n\
         python3 -m verl.trainer.main_ppo \"${DATA[@]}\" $EXTRA \"$QUOTED\" ${DATA[1]} \"$@\"\n",
        &[],
    );
    assert_eq!(
        args(&l),
        [
            "data.train_files=/home/u/t.parquet",
            "data.shuffle=False",
            "data.seed=1",
            "a=1",
            "b=2",
            "c=1 d=2",
            "data.shuffle=False",
        ]
    );
}

#[test]
fn parameter_expansions_follow_bash() {
    let l = read(
        "MODEL_PATH=/models/Qwen2.5-3B-Instruct\nCFG=\"actor_rollout_ref.actor.x=1\"\n\
         E=${E:=fsdp}\nU=vLLM\n\
         python3 -m verl.trainer.main_ppo a=${MODEL_PATH##*/} b=${MODEL_PATH%/*} c=${#U} \
         d=${CFG//actor_rollout_ref.actor/critic} e=$E f=${U,,} g=${U^^} h=${MODEL_PATH:8:4} \
         i=${NOPE:+x} j=${1:-first} k=${E:+set} l=$((7 % 4 ** 2 - -1))\n",
        &[],
    );
    assert_eq!(
        args(&l),
        [
            "a=Qwen2.5-3B-Instruct",
            "b=/models",
            "c=4",
            "d=critic.x=1",
            "e=fsdp",
            "f=vllm",
            "g=VLLM",
            "h=Qwen",
            "i=",
            "j=first",
            "k=set",
            "l=8",
        ]
    );
}

#[test]
fn branches_with_tests_are_followed_and_others_are_unknown() {
    let script = "backend=${BACKEND:-fsdp}\n\
        if [ \"$backend\" = megatron ]; then\n  S=mcore\nelif [[ $backend == fsdp* ]]; then\n  S=fsdp\nelse\n  S=other\nfi\n\
        [ -z \"$N\" ] && N=8\n[ -n \"$N\" ] || N=9\n\
        if command -v nvidia-smi; then GPU=yes; fi\n\
        for i in 1 2; do LOOP=$i; done\n\
        case $backend in\n  fsdp) C=1 ;;\nesac\n\
        NOW=$(date +%Y%m%d)\n\
        python3 -m verl.trainer.main_ppo s=$S n=$N gpu=$GPU loop=$LOOP c=$C now=$NOW \
        missing=$MISSING arg=$1 d=$(pwd)/x\n";
    let got = args(&read(script, &[]));
    assert_eq!(got[..2], ["s=fsdp", "n=8"]);
    for (k, why) in [
        (
            2,
            "`$GPU` is set inside an `if` whose condition (`command -v nvidia-smi`, line 11)",
        ),
        (3, "`$LOOP` is set inside the loop at line 12"),
        (4, "`$C` is set inside the `case` at line 13"),
        (
            5,
            "`$NOW`, set on line 16: `$(date +%Y%m%d)` is a command's output, which is not run here",
        ),
        (
            6,
            "`$MISSING` is set neither by the script nor in the environment",
        ),
        (
            7,
            "`$1` is the script's argument 1, and it was given 0 (give them after the script",
        ),
    ] {
        assert!(
            got[k].starts_with('!') && got[k].contains(why),
            "{k}: {}",
            got[k]
        );
    }
    assert_eq!(got[8], "d=/work/x");
    // the script's arguments, when given
    let given = ["ARG1".to_owned(), "k=v".to_owned()];
    let l = read_with(
        "python3 -m verl.trainer.main_ppo a=$1 n=$# \"$@\" $3\n",
        &[],
        &given,
    );
    assert_eq!(args(&l)[..4], ["a=ARG1", "n=2", "ARG1", "k=v"]);
    assert!(args(&l)[4].contains("`$3` is the script's argument 3, and it was given 2"));
    // the other branch, from the environment
    let got = args(&read(script, &[("BACKEND", "megatron"), ("N", "3")]));
    assert_eq!(got[..2], ["s=mcore", "n=3"]);
    // a `cd` makes `$(pwd)` unknown; a `source` makes every unset variable unknown
    let got = args(&read(
        "cd /elsewhere\nsource env.sh\npython3 -m verl.trainer.main_ppo d=$(pwd) m=$M\n",
        &[],
    ));
    assert!(
        got[0].contains("`$(pwd)` after `cd` (line 1)"),
        "{}",
        got[0]
    );
    assert!(
        got[1].contains("unless `source env.sh` (line 2) sets it"),
        "{}",
        got[1]
    );
}

#[test]
fn the_launch_that_runs_is_the_one_read() {
    // in a branch not taken: the next launch is the one
    let l = read(
        "if [ 1 -eq 2 ]; then\n  python3 -m verl.trainer.main_ppo a=1\nfi\n\
         f() { python3 -m verl.trainer.main_ppo in_function=1; }\n\
         function g() {\n  date\n}\nfunction h {\n  python3 -m verl.trainer.main_ppo in_h=1\n}\n\
         python3 -m verl.trainer.main_ppo b=2\n",
        &[],
    );
    assert_eq!(args(&l), ["b=2"]);
    // in a branch whose condition is not followed: read, and said
    let l = read(
        "if some_check; then\n  python3 -m verl.trainer.main_ppo a=1\nfi\n",
        &[],
    );
    assert_eq!(args(&l), ["a=1"]);
    assert!(
        l.conditional
            .as_deref()
            .unwrap()
            .contains("(`some_check`, line 1)"),
        "{:?}",
        l.conditional
    );
    // a `\` before blanks and a comment ends the command: what follows is said
    let l = read(
        "python3 -m verl.trainer.main_ppo \\\n  a.b=1 \\  # note\n  c.d=2 \\\n  e.f=3\n",
        &[],
    );
    assert_eq!(args(&l), ["a.b=1", " "]);
    assert_eq!(l.cut, Some((3, "c.d=2".to_owned())));
    assert_eq!(
        bash_args("python3 -m verl.trainer.main_ppo \\\n  a.b=1 \\  # note\n  c.d=2\n"),
        ["a.b=1", " "]
    );
    // no launch at all
    let none = launch(
        "echo hello\n",
        Env {
            var: &|_| None,
            cwd: None,
            args: &[],
        },
        &|w| w == ENTRY,
    )
    .unwrap();
    assert!(none.is_none());
}

/// The arguments bash itself passes to the entry point of `script`, run with `python3` as a
/// function that prints them (in a fresh directory, `$HOME=/home/u`, nothing else set).
fn bash_args(script: &str) -> Vec<String> {
    bash_args_with(script, &[])
}

/// [`bash_args`] with the script run with `script_args`.
fn bash_args_with(script: &str, script_args: &[&str]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let shim = "python3() { shift 2; printf '%s\\0' \"$@\"; exit 0; }\n";
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!("{shim}{script}"))
        .arg("script.sh")
        .args(script_args)
        .current_dir(dir.path())
        .env_clear()
        .env("HOME", "/home/u")
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_terminator('\0')
        .map(str::to_owned)
        .collect()
}

#[test]
fn bash_passes_the_same_arguments() {
    let scripts = [
        "gsm8k=$HOME/data/gsm8k/train.parquet\nmath=~/data/math.parquet\n\
         files=\"['$gsm8k', '$math']\"\nM=${M:-Qwen/Qwen2-7B}; L=$((1024 * 2))\n\
         python3 -m verl.trainer.main_ppo data.train_files=\"$files\" m=$M l=${L} \
         t=$(((L + 1024) * 2)) trainer.logger='[\"console\"]' x=\"\" \"$@\" 2>&1 | tee log.txt\n",
        "DATA=(\n  d.a=\"$HOME/t\"  # c\n  d.b=False\n)\nDATA+=(d.c=1)\nE=\"a=1  b=2 \"\nQ=\"c=1 d=2\"\n\
         python3 -m verl.trainer.main_ppo \"${DATA[@]}\" $E \"$Q\" ${DATA[1]} pre${DATA[@]}post \"$@\"\n",
        "P=/m/Qwen2.5-3B-Instruct\nC=\"actor.x=1 actor.y=2\"\nE=${E:=fsdp}\nU=vLLM\n\
         python3 -m verl.trainer.main_ppo a=${P##*/} b=${P%/*} c=${#U} ${C//actor/critic} e=$E \
         f=${U,,} g=${U^^} h=${P:3:4} i=${N:+x} j=${1:-first} k=${E:+set} l=$((7 % 4 ** 2 - -1)) \
         m=${P#*/} n=${P%%.*} o=${U:-} p=${U,}\n",
        "b=${B:-fsdp}\nif [ \"$b\" = megatron ]; then\n  S=mcore\nelif [[ $b == fsdp* ]]; then\n  S=fsdp\n\
         else\n  S=other\nfi\n[ -z \"$N\" ] && N=8\n[ -n \"$N\" ] || N=9\nif [ $N -gt 4 ]; then T=big; fi\n\
         if [ 1 -eq 2 ]; then\n  python3 -m verl.trainer.main_ppo wrong=1\nfi\n\
         f() { python3 -m verl.trainer.main_ppo in_function=1; }\n\
         function g() {\n  date\n}\n\
         python3 -m verl.trainer.main_ppo s=$S n=$N t=$T d=$(pwd)\n",
    ];
    for script in scripts {
        let ours = read(script, &[]);
        let mut ours = args(&ours);
        let bash = bash_args(script);
        // `$(pwd)`: bash ran in a temporary directory, this reading in /work
        if let (Some(o), Some(b)) = (ours.last_mut(), bash.last())
            && o == "d=/work"
        {
            *o = b.clone();
        }
        assert_eq!(ours, bash, "{script}");
    }
}

/// Scripts a review found read otherwise than bash reads them: each now reads as bash.
#[test]
fn bash_agrees_on_what_a_review_found() {
    let cases: &[(&str, &[&str])] = &[
        // list slices
        (
            "python3 -m verl.trainer.main_ppo \"${@:2}\"\n",
            &["4", "a.b=x y", "c.d=3"],
        ),
        (
            "A=(a.b=1 c.d=2 e.f=3); python3 -m verl.trainer.main_ppo \"${A[@]:1:1}\" ${A[@]: -1}\n",
            &[],
        ),
        // `||`/`&&` at the end of a line, a group after them, a subshell's assignments
        (
            "M=${1:-}\n[ -n \"$M\" ] || {\n  M=Qwen/Qwen2-7B\n}\nN=${N:-4}\n[ -z \"$N\" ] &&\n  N=8\n(X=b)\n\
          python3 -m verl.trainer.main_ppo m=$M n=$N x=${X:-a}\n",
            &["my/model"],
        ),
        (
            "M=${1:-}\n[ -n \"$M\" ] || {\n  M=Qwen/Qwen2-7B\n}\npython3 -m verl.trainer.main_ppo m=$M\n",
            &[],
        ),
        // `[[ ]]` patterns: quoted parts literal, classes, negation, string order
        (
            "M=Qwen2-7B; P=Qw; a=d\nif [[ $M == *\"Qwen\"* ]]; then S=yes; else S=no; fi\n\
          if [[ $M == \"$P\"* ]]; then T=yes; else T=no; fi\n\
          if [[ $M == [PQ]* ]]; then U=yes; else U=no; fi\n\
          if [[ ! $M == fsdp* ]]; then V=yes; else V=no; fi\n\
          if [[ $a < c ]]; then W=yes; else W=no; fi\n\
          if [[ $M == \"*\" ]]; then Z=yes; else Z=no; fi\n\
          python3 -m verl.trainer.main_ppo s=$S t=$T u=$U v=$V w=$W z=$Z\n",
            &[],
        ),
        // a function defined with a space before its parentheses, or a hyphen in its name, is
        // not run where it is defined
        (
            "run-it () {\n  python3 -m verl.trainer.main_ppo in_function=1\n}\n\
          python3 -m verl.trainer.main_ppo a=1\n",
            &[],
        ),
        // a quoted default stays one word; `${a[*]}` quoted is one word
        (
            "A=(a b)\npython3 -m verl.trainer.main_ppo d=${TRAIN:-\"[a.parquet, b.parquet]\"} \
          \"e=${A[*]}\" f=${NONE:+\"p q\"}\n",
            &[],
        ),
        // another command naming the entry point is not the launch
        (
            "pgrep -f verl.trainer.main_ppo >/dev/null || true\necho python3 -m verl.trainer.main_ppo x=1 >&2\n\
          python3 -m verl.trainer.main_ppo a.b=1\n",
            &[],
        ),
        // `shift`; an assignment before a command is that command's alone
        (
            "E=$1; shift; M=$1\nX=old; X=new python3 -m verl.trainer.main_ppo m=$M k=$X \"$@\"\n",
            &["vllm", "Qwen/Qwen2-7B", "z.z=1"],
        ),
        (
            "N=4 true; python3 -m verl.trainer.main_ppo k=${N:-unset}\n",
            &[],
        ),
        // arithmetic: octal, precedence
        (
            "python3 -m verl.trainer.main_ppo a=$((010)) b=$((2 == 2 > 0)) c=$((3 - -2 * 2))\n",
            &[],
        ),
    ];
    for (script, script_args) in cases {
        let given: Vec<String> = script_args.iter().map(|a| a.to_string()).collect();
        let ours = args(&read_with(script, &[], &given));
        assert_eq!(ours, bash_args_with(script, script_args), "{script}");
    }
}

/// What bash would compute but this reader does not follow is said, never guessed, and no
/// script hangs or panics it.
#[test]
fn what_is_not_followed_is_said_and_nothing_hangs() {
    let got = args(&read(
        "G=4; ((T=G*2)); ((G++))\ncd /tmp\nM=Qwen/Qwen2-7B\n\
         if [ -f /nonexist ]; then : \"${N:=4}\"; fi\nA=(x y); A[1]=z\n\
         python3 -m verl.trainer.main_ppo t=$T d=$PWD/x e=${M//\\//_} n=$N a=${A[1]} \
         s=${M:1:9223372036854775807} o=$(( -(-9223372036854775807-1) ))\n",
        &[],
    ));
    for (k, why) in [
        (0, "`$T` may be changed by `((T=G*2))` on line 1"),
        (1, "`$PWD` after `cd` (line 2)"),
        (2, "a form of expansion not followed here"),
        (
            3,
            "`$N` is set inside an `if` whose condition (`[ -f /nonexist ]`, line 4)",
        ),
        (4, "`$A` has an element set on line 5"),
        (6, "not arithmetic followed here"),
    ] {
        assert!(
            got[k].starts_with('!') && got[k].contains(why),
            "{k}: {}",
            got[k]
        );
    }
    assert_eq!(got[5], "s=wen/Qwen2-7B");
    // a variable a function sets may be set wherever it is called
    let got = args(&read(
        "X=1; setup () { X=2; }\npython3 -m verl.trainer.main_ppo a=$X\n",
        &[],
    ));
    assert!(
        got[0].contains("`$X` is set inside the function `setup`"),
        "{}",
        got[0]
    );
    // a process substitution inside an array is an error, not a hang
    let err = launch(
        "A=(<(echo hi))\npython3 -m verl.trainer.main_ppo\n",
        Env {
            var: &|_| None,
            cwd: None,
            args: &[],
        },
        &|w| w == ENTRY,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("line 1: `<` inside an array is not read here"),
        "{err}"
    );
    // a verl command only inside a function: read, and said
    let l = read(
        "main() {\n  python3 -m verl.trainer.main_ppo a.b=1 \"$@\"\n}\nmain \"$@\"\n",
        &[],
    );
    assert_eq!(args(&l), ["a.b=1"]);
    assert!(
        l.conditional
            .as_deref()
            .unwrap()
            .contains("inside the function `main`"),
        "{:?}",
        l.conditional
    );
}
